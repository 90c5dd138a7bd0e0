"""The data types and their files: profile, cluster, plan, timeline, run report, imports and exports."""
