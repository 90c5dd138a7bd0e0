"""Tables, plots and HTML for profiles, plans, timelines and run reports."""
