"""Shared plumbing for the course, one module per concern (nothing here is a lesson):

distributed  setup/teardown: torchrun, Slurm or one process; device and backend choice
config       typed dataclass configs and their documented --flags
log          rank-aware logging and progress
seed         seeding and RNG state capture
results      summary.json, metrics.jsonl, TensorBoard and the checks table
models       MLP, SmallCNN, TinyGPT
data         offline synthetic, image and text data
checkpoint   atomic save, safe load
timing       timers, throughput, matmul peak, MFU
launch       torchrun launches and N-rank gloo runs, for tests and notebooks
"""
