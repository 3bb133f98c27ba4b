"""Starting processes and stopping them with the run: the orphan guard and the reaper (verl_kit.launch.processes,
which rollout/ uses for the vLLM processes it starts), and a recipe launched on a Ray cluster
(`python -m verl_kit.launch.cluster`). Nothing here imports rollout/ or train/."""
