"""Stage 1, workloads: deterministic seeded scenarios (registry with static tags) and the one
chooser of which scenarios judge a toggle."""
