"""``attnchat bench``: the side-by-side benchmark (:mod:`.command`), each engine in its own
process (:mod:`.worker`); the GPU checks (:mod:`.gpu_check`, ``make gpu-check``) and the cost
of attention capture (:mod:`.capture_cost`).
"""
