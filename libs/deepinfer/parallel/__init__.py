"""Parallelism across the devices of one worker: expert parallelism for the MoE layers (``expert_parallel``, over an
``all_to_all.AllToAll``, experts placed by ``placement``)."""
