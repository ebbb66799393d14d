"""Shared inputs for the msprobe fixtures: the logdiff demo Qwen3 and fixed token ids."""
import os
MODEL = os.path.expanduser("~/.cache/logdiff/test-models/qwen3-552b137b6ecf")  # model_type qwen3 (not qwen3-moe)
# three prompts of 12, 9 and 16 tokens (ids in [5, 4096)); step 0: right-padded batch; step 1: one unpadded prompt
PROMPTS = [
    [17, 301, 2048, 77, 1500, 9, 640, 3333, 12, 815, 4000, 256],
    [88, 1024, 5, 919, 2222, 70, 345, 3100, 61],
    [400, 401, 402, 1999, 58, 7, 3500, 2750, 111, 222, 333, 444, 555, 666, 777, 888],
]
UNPADDED = [[1234, 56, 789, 1011, 1213, 1415, 1617, 1819, 2021, 2223]]
PAD = 0
