"""Degrees and meshes (parallel_dims), the sharding applier (parallelize: TP/SP, AC,
compile, FSDP/HSDP/DDP), devices, and communication: counted (comm_counting) and analytic
(comm_model)."""
