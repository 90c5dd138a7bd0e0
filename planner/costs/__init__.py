"""Pure cost models: a stage's time and memory from layer sums, the planner's and PipeDream's."""
