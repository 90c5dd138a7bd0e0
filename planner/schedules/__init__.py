"""The one schedule representation: what each rank runs, in order, for every schedule."""
