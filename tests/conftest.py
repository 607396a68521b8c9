import os

# Ranks started by the tests share two cores: one thread each, as torchrun gives them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
