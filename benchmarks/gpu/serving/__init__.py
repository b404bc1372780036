"""The GPU serving run (`scripts/gpu_serving.sh`): its device plan (`plan`), the run and its
report (`run`), the phases on live servers (`phases`), the random checkpoints it serves
(`checkpoint`), the scheduler log it reads (`schedlog`) and its result record (`record`)."""
