"""A CUDA machine: the GPU figures, and the tools that prepare a run there without network
(the device plan, the CPU preflight, the wheelhouse; `scripts/gpu_serving.sh` runs them)."""
