"""The engine: its API and the engine process, the scheduler, the block manager, sampling, CUDA graphs, the model
runner on the GPU."""
