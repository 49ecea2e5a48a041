"""Degrees and meshes (parallel_dims, world_mesh), the sharding applier (parallelize: TP/SP,
context parallel, AC, compile, FSDP/HSDP/DDP) with float8 linears (float8), pipeline stages
(pipeline, pipeline_settings), context parallel's attention (context_parallel), where groups
sit on nodes (topology), devices (hardware), the step's own all-reduce (step_stats), and
communication: counted (comm_counting) and analytic (comm_model)."""
