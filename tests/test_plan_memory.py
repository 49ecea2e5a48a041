"""The planner's memory phase by phase: a peak that does not depend on the depths measured,
equal to the tracker's measurement of the whole model, and accumulation that saves memory under
``trainer.accum_reduce=every`` (FSDP reduce-scatters every micro-batch) but not under ``last``."""

import json

import pytest
from clusters import fake_cluster
from omegaconf import OmegaConf

from hsdp_runner import plan
from hsdp_runner.distributed.comm_model import unit_sizes
from hsdp_runner.distributed.parallel_dims import ParallelDims
from hsdp_runner.planner import layout_memory, mem_phases
from hsdp_runner.planner import memory as plan_memory
from hsdp_runner.planner.layouts import plan_layouts

# An 8-block model whose blocks are wide and its sequences short (parameters outweigh
# activations), so that FSDP's buffers of neighbouring blocks decide the peak: the shape on which
# extrapolating the tracker's peak moment moved with the depths measured.
WIDE = [
    "model=llama3_tiny",
    "model.n_layers=8",
    "model.dim=512",
    "model.ffn_hidden_dim=2048",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.seq_len=64",
    "model.vocab_size=4096",
    "cluster.gpus_per_node=4",
]
TINY = ["model=llama3_tiny", "model.seq_len=256", "cluster.gpus_per_node=4"]
FSDP = {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HSDP_RUNNER_CACHE_DIR", str(tmp_path))


def _peak(overrides: list[str], fixed: dict) -> dict:
    row = plan_layouts(plan.compose(overrides), fake_cluster(nodes=1), {}, fixed)[0]
    return row["memory"]


def _largest_phase(phases: dict) -> float:
    return max(cats["total"] for cats in phases.values())


def _peak_moment_extrapolated(a: dict, b: dict, da: int, db: int, n: int) -> float:
    """What the planner did before phases: each category at the tracker's peak moment, linear
    per block from two depths (clamped at zero), summed."""
    per = {k: (b.get(k, 0) - a.get(k, 0)) / (db - da) for k in set(a) | set(b) if k != "total"}
    return sum(max(0.0, a.get(k, 0) + (n - da) * per[k]) for k in per)


def test_peak_is_the_same_from_any_two_depths_and_equals_the_whole_model(cache):
    """FSDP 4, one 64-token sequence per rank: the largest phase extrapolated from [1, 2] and from
    [2, 3] agree, and equal the tracker's own peak of the 8-block model measured whole (within
    5%); extrapolating the peak moment instead misses by more than 30% from [1, 2]."""
    cfg = plan.compose(WIDE)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    depths = (1, 2, 3, 8)
    requests = [
        plan_memory.request(
            plain["model"],
            plain["parallel"],
            plain["precision"],
            [],
            (1, 4, 1, 1),
            1,
            1,
            4,
            4,
            d,
            accum_reduce="every",
        )
        for d in depths
    ]
    got = dict(zip(depths, plan_memory.measure(requests)))
    whole = got[8]["peak"]["total"]
    assert _largest_phase(got[8]["phases"]) == whole  # the phases cover the step
    for pair in ((1, 2), (2, 3)):
        phases = mem_phases.extrapolate({d: got[d] for d in pair}, 8)
        predicted = _largest_phase(phases)
        assert abs(predicted / whole - 1) <= 0.05, pair
        # What a pipeline stage is priced from (``layout_memory``): what a micro-batch leaves
        # held and the peak without the output layer's and loss's phases, whatever the depths.
        for got_part, want_part in zip(_pipeline_parts(phases), _pipeline_parts(got[8]["phases"])):
            assert abs(got_part / want_part - 1) <= 0.05, pair
    before = _peak_moment_extrapolated(got[1]["peak"], got[2]["peak"], 1, 2, 8)
    assert before / whole - 1 > 0.3


def _pipeline_parts(phases: dict) -> tuple[float, float, float]:
    """(what a micro-batch leaves held through the blocks, and through its loss; the largest
    phase but the output layer's and the loss's) of a measurement's phases, as
    ``layout_memory`` reads them."""
    skip = set(layout_memory.HEAD_PHASES) | set(mem_phases.MOMENTS)
    rest = max(c["total"] for k, c in phases.items() if k.split("/")[1] not in skip)
    return phases["0/at:blocks_end"]["act"], phases["0/at:loss_end"]["act"], rest


def test_a_cached_measurement_is_reused_only_under_the_torch_it_was_measured_with(
    cache, monkeypatch
):
    """The disk cache answers a request it holds without measuring; another torch version
    names another file, so an upgrade measures afresh instead of reading the old figures."""
    import torch

    from hsdp_runner.distributed.hardware import cache_dir

    req = plan_memory.request(
        {"name": "llama3_tiny"}, {}, {}, [], (1, 8), 1, 1, 4, 4, 2, accum_reduce="every"
    )
    held = {"phases": {"0/fw:head": {"act": 1.0}}}
    path = cache_dir() / "memory" / f"{plan_memory._key(req)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(held))
    assert plan_memory.measure([req]) == [held]  # no child started: it would fail on this model
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".next")
    assert not (cache_dir() / "memory" / f"{plan_memory._key(req)}.json").exists()


def test_extrapolation_grows_each_phase_by_what_it_holds_of_the_other_blocks():
    """A phase after the forward grows by the end-of-forward growth per block, one after the
    backward by the end-of-backward growth, and an interior block's backward holds both the
    all-gather seen at the last block and the reduce-scatter seen at the first."""

    def result(depth: int) -> dict:
        marks = {
            "0/start": {"sharded_param": 2 * depth, "total": 2 * depth},
            "0/end_fw": {"sharded_param": 2 * depth, "act": 10 * depth, "total": 12 * depth},
            "0/end_bw": {"sharded_param": 2 * depth, "sharded_grad": depth, "total": 3 * depth},
        }
        p = 2 * depth  # every block's sharded parameters, in every phase
        phases = {
            "0/loss_bw": {"sharded_param": p, "act": 10 * depth, "temp": 50},
            "0/bw:last": {"sharded_param": p, "act": 10 * depth, "all_gather": 4},
            "0/bw:first": {"sharded_param": p, "sharded_grad": depth, "reduce_scatter": 8},
        }
        for cats in phases.values():
            cats["total"] = sum(cats.values())
        return {"phases": phases, "marks": marks}

    for depths in ((1, 2), (2, 3), (3, 4)):
        out = mem_phases.extrapolate({d: result(d) for d in depths}, 40)
        assert out["0/loss_bw"]["total"] == 40 * 12 + 50
        assert out["0/bw:first"]["total"] == 40 * 3 + 8
        # Next to the last block: one block fewer below (-12), one more above (+3), plus the
        # reduce-scatter in flight from the block above (+8).
        assert out["0/bw:mid"]["total"] == out["0/bw:last"]["total"] - 12 + 3 + 8
    whole = result(5)
    assert mem_phases.extrapolate({4: result(4), 5: whole}, 5) == whole["phases"]


def test_accumulation_saves_memory_when_every_micro_batch_is_reduced(cache):
    """FSDP 4, 8 sequences a step: with 2 micro-batches of 1 instead of 1 of 2, ``every``
    (each micro-batch reduce-scattered, gradients stay sharded) predicts a lower peak, about
    one micro-batch's; ``last`` holds the whole model's unsharded gradients (fp32, one TP rank's
    part) through the second micro-batch, and the tracker sees exactly those bytes at its
    start; so do whole replicas (DDP), which never reduce before the last micro-batch."""
    accum = ["trainer.global_batch_size=8", "trainer.grad_accum_steps=2"]
    one = _peak(TINY + ["trainer.global_batch_size=4"], FSDP)["peak_gib"]
    two = _peak(TINY + ["trainer.global_batch_size=8"], FSDP)["peak_gib"]
    every = _peak(TINY + accum, FSDP)
    last = _peak(TINY + accum + ["trainer.accum_reduce=last"], FSDP)
    assert every["peak_gib"] < two
    assert every["peak_gib"] <= one * 1.05
    assert last["peak_gib"] > every["peak_gib"]
    assert "micro-batch 2 of 2" in every["peak_phase"]

    cfg = plan.compose(TINY + ["model.n_layers=1"])
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    requests = [
        plan_memory.request(
            plain["model"],
            plain["parallel"],
            plain["precision"],
            [],
            shape,
            1,
            2,
            4,
            4,
            1,
            accum_reduce=reduce,
        )
        for shape, reduce in (((1, 4, 1, 1), "last"), ((4, 1, 1, 1), "every"))
    ]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1, ranks_per_node=4)
    whole = 4 * sum(u[1] for u in unit_sizes(cfg.model, dims).values())
    for got in plan_memory.measure(requests, use_disk_cache=False):
        assert got["marks"]["1/start"]["unsharded_grad"] == whole


def one_request(
    overrides: list[str], shape=(1, 1, 1, 1), rows=2, world=1, n_layers=None, experts=None
) -> dict:
    """The measuring child's request for ``plan.compose(overrides)`` on ``shape``
    (dp_replicate, dp_shard, cp, tp) of ``world`` ranks: one micro-batch of ``rows`` rows,
    ``n_layers`` blocks (default the model's; (dense, MoE) blocks for a model with experts),
    ``experts`` ({'ep', 'imbalance'}) for a model with experts; the loss as
    ``trainer.chunked_loss`` and ``trainer.loss_fp32`` say."""
    cfg = plan.compose(overrides)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return plan_memory.request(
        plain["model"],
        plain["parallel"],
        plain["precision"],
        [],
        shape,
        rows,
        1,
        world,
        world,
        n_layers or cfg.model.n_layers,
        accum_reduce="every",
        experts=experts,
        chunked_loss=cfg.trainer.chunked_loss,
        loss_fp32=cfg.trainer.loss_fp32,
    )


def test_the_loss_in_chunks_or_in_bf16_is_measured_as_a_job_computes_it():
    """Tiny Llama in bf16 with a 65,536-token vocabulary, 2 x 1,024 tokens: 2^27 logits, two
    chunks of 2^26 with ``trainer.chunked_loss``. One cross-entropy holds at backward's peak
    three fp32 tensors of the logits' size (the log-probabilities, their gradient and the fp32
    copy's: 512 MiB each); the chunks the bf16 logits' gradient and one chunk's fp32 work:
    384 MiB less at the step's peak. With ``trainer.loss_fp32=false`` the one cross-entropy
    holds the same three in bf16: 3 x 256 MiB less."""
    base = ["model=llama3_tiny", "model.vocab_size=65536", "model.seq_len=1024", "precision=bf16"]
    requests = [
        one_request([*base, *overrides])
        for overrides in (
            ["trainer.chunked_loss=false"],
            ["trainer.chunked_loss=true"],
            ["trainer.loss_fp32=false"],
        )
    ]
    whole, chunked, in_bf16 = (r["peak"]["total"] for r in plan_memory.measure(requests, False))
    assert whole - chunked == 3 * 2**27, (whole / 2**20, chunked / 2**20)
    assert whole - in_bf16 == 3 * 2**28, (whole / 2**20, in_bf16 / 2**20)


def _fake_and_real_steps(req: dict) -> tuple[dict, dict]:
    """In a measuring child: one request's phases measured as the planner does (fake tensors)
    and from the same step on real tensors."""
    plan_memory._untracked_dtensor_meta()
    plan_memory._join(req["world_size"])
    return plan_memory._measure_one(req)["phases"], plan_memory._measure_one(req, fake=False)[
        "phases"
    ]


def test_tp_layouts_are_measured_as_the_same_step_holds_on_real_tensors():
    """DTensor's shape inference runs ops on whole-size fake tensors; they are not the rank's.
    TP 2 with a vocabulary large enough that the logits decide the peak, the loss on
    vocabulary-sharded logits (``parallel.loss_parallel``) and on gathered ones: every phase
    equals the real step's (the fake one counted the whole vocabulary's logits in the output
    layer's forward, and the whole embedding table in its forward)."""
    requests = [
        one_request(
            ["model=llama3_tiny", "model.vocab_size=8192", "cluster.gpus_per_node=2"]
            + ["parallel.tp=2", f"parallel.loss_parallel={loss_parallel}"],
            shape=(1, 1, 1, 2),
            world=2,
        )
        for loss_parallel in ("true", "false")
    ]
    pool = plan_memory._children()
    results = [f.result() for f in [pool.submit(_fake_and_real_steps, r) for r in requests]]
    for fake, real in results:
        assert {k: v["total"] for k, v in fake.items()} == {k: v["total"] for k, v in real.items()}
    # The loss on vocabulary-sharded logits holds less than on gathered ones.
    (sharded, _), (gathered, _) = results
    assert _largest_phase(sharded) < _largest_phase(gathered)


def _moments(req: dict) -> dict:
    """In a measuring child: the moments (``mem_phases.MOMENTS``) of one request, act bytes."""
    plan_memory._untracked_dtensor_meta()
    plan_memory._join(req["world_size"])
    phases = plan_memory._measure_one(req)["phases"]
    return {k: v.get("act", 0) for k, v in phases.items() if "/at:" in k}


def _moments_unshared(req: dict) -> dict:
    """``_moments`` with context parallel's two attention outputs saved apart, as torch saves
    them (``context_parallel._SharedOutput`` left out)."""
    from hsdp_runner.distributed import context_parallel

    point_at = context_parallel._SharedOutput.point_at
    context_parallel._SharedOutput.point_at = lambda self, outs, joined: None
    try:
        return _moments(req)
    finally:
        context_parallel._SharedOutput.point_at = point_at


def test_a_gpu_jobs_cp_attention_is_measured_without_the_mask_a_cpu_job_holds():
    """cp 2 in bf16, 2 x 256 tokens: rank 0 holds chunks 0 and 3 of 4 (64 tokens each);
    chunk 3's queries attend to all 256 keys under the lower-right causal bias, which torch
    materialises on CPU as a 64 x 256 mask that attention saves, and CUDA's flash kernel takes
    as a flag (``memory.cuda_causal_bias``). Measured for a CPU cluster every block holds that
    mask; for a GPU cluster it holds the flash kernel's random-number state instead (a seed
    and an offset, 24 bytes), and nothing else differs. Each block saves its attention output
    once (the two chunks' outputs are views of the joined one): saved apart, a block holds
    one more output, 2 rows x 128 tokens x 4 heads x 16 channels."""
    overrides = [*TINY, "precision=bf16", "parallel.cp=2"]
    cfg = plan.compose(overrides)
    pool = plan_memory._children()
    held = {}
    for name, device_type, measure in (
        ("cpu", "cpu", _moments),
        ("cuda", "cuda", _moments),
        ("cuda_unshared", "cuda", _moments_unshared),
    ):
        req = one_request(overrides, shape=(1, 1, 2, 1), world=2)
        req["device_type"] = device_type
        held[name] = pool.submit(measure, req).result()["0/at:blocks_end"]
    mask, rng_state, output = 64 * 256 * 2, 24, 2 * 128 * 4 * 16 * 2
    assert held["cpu"] - held["cuda"] == cfg.model.n_layers * (mask - rng_state)
    assert held["cuda_unshared"] - held["cuda"] == cfg.model.n_layers * output


def test_sequence_parallel_saving_shards_holds_one_shard_of_each_gathered_input():
    """TP 2 with sequence parallel, fp32, 2 x 256 tokens: each block's attention and
    feed-forward linears save the gathered input (rows x seq x dim); with
    ``parallel.sp_save_shard`` they keep the rank's shard of it instead (``sp_saves``), so
    through the blocks' forward each block holds (1 - 1/tp) of two gathered inputs less, to
    the byte."""
    overrides = [*TINY, "parallel.tp=2"]
    cfg = plan.compose(overrides)
    pool = plan_memory._children()
    held = {
        save: pool.submit(
            _moments,
            one_request([*overrides, f"parallel.sp_save_shard={save}"], (1, 1, 1, 2), world=2),
        ).result()["0/at:blocks_end"]
        for save in ("false", "true")
    }
    gathered = 2 * cfg.model.seq_len * cfg.model.dim * 4
    assert held["false"] - held["true"] == cfg.model.n_layers * 2 * gathered // 2


def _gathers_again(req: dict) -> list[tuple[bool, int, int]]:
    """In a measuring child: one request's step, and for each gather again of a saved shard
    (``sp_saves._ShardSaves.prefetch``) whether another saved tensor's unpack started it, and
    how many of the shard's views had been unpacked and were packed."""
    from hsdp_runner.distributed import sp_saves

    events = []
    prefetch = sp_saves._ShardSaves.prefetch

    def recorded(self, early=False):
        issued = self.again is None and self.unpacked < self.packed
        prefetch(self, early)
        if issued:
            events.append((self.early, self.unpacked, self.packed))

    sp_saves._ShardSaves.prefetch = recorded
    try:
        plan_memory._untracked_dtensor_meta()
        plan_memory._join(req["world_size"])
        plan_memory._measure_one(req)
    finally:
        sp_saves._ShardSaves.prefetch = prefetch
    return events


def test_each_saved_shard_is_gathered_again_once_before_its_linears_backward():
    """TP 2 with sequence parallel saving shards: each block's attention and feed-forward
    gather their input again once a step, started at the first unpack of another tensor the
    module saved (its last linear's backward), before any of the column-parallel linears that
    saved the views (attention's wq, wk, wv; the feed-forward's w1, w3) unpacks one."""
    overrides = [*TINY, "parallel.tp=2", "parallel.sp_save_shard=true"]
    cfg = plan.compose(overrides)
    req = one_request(overrides, (1, 1, 1, 2), world=2)
    events = plan_memory._children().submit(_gathers_again, req).result()
    # Backward's order, block by block from the last: the feed-forward's (w1, w3), then the
    # attention's (wq, wk, wv).
    assert events == [(True, 0, 2), (True, 0, 3)] * cfg.model.n_layers, events


def test_what_a_micro_batch_leaves_held_is_the_blocks_inputs_and_the_last_output():
    """What a pipeline stage holds per micro-batch in flight (``saved_activations_gib``):
    under full AC every block keeps its input and the last block's output is kept, exactly
    (blocks + 1) hidden states; the loss's end adds the logits and what the loss saved. The
    largest moment of the last block's forward, used before, also held that block's working
    tensors: 1F1B's first stage on two CPU ranks came out 11% high with it (docs/planner.md)."""
    cfg = plan.compose(["model=llama3_tiny", "parallel.ac=full"])
    rows = 2
    hidden = rows * cfg.model.seq_len * cfg.model.dim * 4  # fp32
    pool = plan_memory._children()
    for blocks in (2, 3):
        req = one_request(["model=llama3_tiny", "parallel.ac=full"], rows=rows, n_layers=blocks)
        held = pool.submit(_moments, req).result()
        assert held["0/at:blocks_end"] == (blocks + 1) * hidden
        logits = rows * cfg.model.seq_len * cfg.model.vocab_size * 4
        assert held["0/at:loss_end"] - held["0/at:blocks_end"] > logits


def _described(model) -> dict:
    """What a built model is, by name: each module's class, and each parameter's dtype,
    placements, mesh dims, local shape and the class of its local tensor (torchao's float8
    weight wrapper under float8 all-gather)."""
    modules = {name: type(m).__name__ for name, m in model.named_modules()}
    params = {}
    for name, p in model.named_parameters():
        local = p._local_tensor if hasattr(p, "_local_tensor") else p
        params[name] = (
            str(p.dtype),
            tuple(str(x) for x in getattr(p, "placements", ())),
            tuple(p.device_mesh.mesh_dim_names) if hasattr(p, "device_mesh") else (),
            tuple(local.shape),
            type(local).__name__,
        )
    return {"modules": modules, "params": params}


def _job_and_measured_builds(cases: dict) -> dict:
    """In a measuring child, per ``{name: (typed config, its measuring request)}``: (the job's
    build of global rank 0's stage chunk, the measuring child's build), each ``_described``,
    each on a fake process group of its own world size (the builds grouped by world size:
    a new fake group clears DTensor's caches)."""
    import torch

    from hsdp_runner.distributed.parallel_dims import ParallelDims
    from hsdp_runner.runtime.rank_training import build_rank_model

    def job(cfg, world):
        dims = ParallelDims.from_config(cfg.parallel, cfg.model, world)
        schedule = build_rank_model(cfg, dims, dims.build_mesh("cpu"), torch.device("cpu"))
        return _described(schedule.parts[0])

    builds = {
        name: (cfg.parallel.pp * req["world_size"], req["world_size"])
        for name, (cfg, req) in cases.items()
    }
    plan_memory._untracked_dtensor_meta()
    jobs, measured = {}, {}
    for world in sorted({w for pair in builds.values() for w in pair}):
        plan_memory._join(world)
        for name, (job_world, measured_world) in builds.items():
            cfg, req = cases[name]
            if job_world == world:
                jobs[name] = job(cfg, world)
            if measured_world == world:
                measured[name] = _described(plan_memory.build_measured(req)[0])
    return {name: (jobs[name], measured[name]) for name in cases}


# Every layout preset (but ``auto``, which plans one) that runs here, with every precision.
PRESETS = [
    "single", "ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "hsdp_tp", "cp", "fsdp_cp",
    "hsdp_cp_tp", "pp", "pp_fsdp", "pp_fsdp_tp", "pp_hsdp",
]  # fmt: skip
PRECISIONS = ["fp32", "bf16", "bf16_pure", "float8", "float8_rowwise"]


def test_the_measuring_child_builds_what_the_job_builds():
    """For every parallel preset x precision preset, the model the planner measures is built by
    the job's code: the same modules (torchao's float8 linears included), parameter dtypes,
    placements, meshes and local shapes as the job's rank 0 holds. Under pipeline parallel the
    planner measures a stage as a whole model of its degrees without pp: rank 0's stage chunk
    (embedding and first blocks) is a part of it, equal wherever the names meet."""
    import dataclasses

    from test_config import compose

    from hsdp_runner.config.compose import plain_config, to_run_config
    from hsdp_runner.distributed.world_mesh import STAGE_DIMS

    def typed(group: str, option: str):
        return getattr(to_run_config(compose(["model=llama3_tiny", f"{group}={option}"])), group)

    base = to_run_config(compose(["model=llama3_tiny"]))
    precisions = {option: typed("precision", option) for option in PRECISIONS}
    cases = {}
    for layout in PRESETS:
        parallel = typed("parallel", layout)
        for option, precision in precisions.items():
            cfg = dataclasses.replace(base, parallel=parallel, precision=precision)
            plain = plain_config(cfg)
            shape = tuple(getattr(parallel, d) for d in STAGE_DIMS)
            world = 1
            for degree in shape:
                world *= degree
            req = plan_memory.request(
                plain["model"], plain["parallel"], plain["precision"], [], shape, 2, 1,
                world, world, cfg.model.n_layers, accum_reduce="every",
            )  # fmt: skip
            cases[f"{layout}/{option}"] = (cfg, req)
    builds = plan_memory._children().submit(_job_and_measured_builds, cases).result()
    float8_linears = 0
    for name, (job, measured) in builds.items():
        pp = cases[name][0].parallel.pp
        if pp == 1:
            assert job == measured, name
        else:
            for kind in ("modules", "params"):
                assert job[kind].items() <= measured[kind].items(), (name, kind)
        float8_linears += sum(kind == "Float8Linear" for kind in measured["modules"].values())
    assert float8_linears  # the float8 presets were converted in both


def test_float8_weights_are_measured_gathered_at_one_byte():
    """FSDP 2 on tiny Llama, bf16 compute: a block's gathered weights hold 49,280 parameters, of
    which its seven linears' 49,152 are float8 (dims multiples of 16) and its two norms' 128
    stay bf16. In the first block's forward the gathered block is 98,560 bytes in bf16 and
    49,152 + 256 + 7 x 4 (each float8 weight's fp32 scale) = 49,436 under float8 all-gather;
    the all-gather buffer 98,560 and 49,408. The root (embeddings, output, final norm: 32,832
    bf16 parameters) stays gathered in both."""
    requests = [
        one_request(
            ["model=llama3_tiny", f"precision={precision}", "cluster.gpus_per_node=2"],
            shape=(1, 2, 1, 1),
            world=2,
        )
        for precision in ("bf16", "float8")
    ]
    bf16, float8 = (r["phases"]["0/fw:first"] for r in plan_memory.measure(requests, False))
    root = 32_832 * 2
    assert bf16["unsharded_param"] - root == 49_280 * 2
    assert float8["unsharded_param"] - root == 49_152 + 128 * 2 + 7 * 4
    assert (bf16["all_gather"], float8["all_gather"]) == (98_560, 49_152 + 128 * 2)


# A model with experts whose first two blocks are dense: 2 dense + 4 MoE blocks, 8 experts.
MOE = ["model=moe_tiny", "model.n_layers=6", "model.n_dense_layers=2", "model.seq_len=64"]
MOE += ["cluster.gpus_per_node=4"]


def _moe_request(
    depth, ep: int, imbalance: float = 1.0, shape=(1, 4, 1, 1), extra: tuple = ()
) -> dict:
    experts = {"ep": ep, "imbalance": imbalance}
    return one_request([*MOE, *extra], shape, rows=2, world=4, n_layers=depth, experts=experts)


def _expert_rows(req: dict) -> tuple[dict, dict, list]:
    """In a measuring child: a request's phases on fake tensors and on real ones, and the rows
    the first MoE layer's exchange received (its planned counts)."""
    from hsdp_runner.distributed.expert_parallel import moe_modules

    plan_memory._untracked_dtensor_meta()
    plan_memory._join(req["world_size"])
    fake = plan_memory._measure_one(req)["phases"]
    real = plan_memory._measure_one(req, fake=False)["phases"]
    model, _, _ = plan_memory.build_measured(req)
    exchange = next(iter(moe_modules(model).values())).exchange
    return fake, real, type(exchange).__name__


def test_expert_layouts_are_measured_as_the_same_step_holds_on_real_tensors():
    """A model with experts on fake tensors: the router's choice is data, so the planner plans
    the routing (``expert_memory``); the fake step then holds, phase by phase, what the same
    step holds on real tensors (FSDP 4 with ep 2 at 1.5x the mean rows, and FSDP 2 x TP 2 with
    ep 1, balanced, and with the MoE feed-forward recomputed, ``parallel.ac=moe``), and the
    busiest rank's extra rows cost activations, which ``parallel.ac=moe`` does not keep."""
    requests = [
        _moe_request((2, 1), ep=2, imbalance=1.5),
        _moe_request((2, 1), ep=1, shape=(1, 2, 1, 2)),
        _moe_request((2, 1), ep=2, imbalance=1.0),
        _moe_request((2, 1), ep=2, imbalance=1.0, extra=("parallel.ac=moe",)),
    ]
    pool = plan_memory._children()
    results = [f.result() for f in [pool.submit(_expert_rows, r) for r in requests]]
    for fake, real, exchange in results:
        # Equal but for the planned counts (a few dozen int64: host values in the fake step,
        # which the real step holds as tensors; 36 of them at the last forward under
        # parallel.ac=moe).
        assert fake.keys() == real.keys()
        assert all(abs(fake[k]["total"] - real[k]["total"]) <= 512 for k in fake), exchange
    assert [r[2] for r in results] == [
        "PlannedTokenExchange",
        "PlannedLocalExchange",
        "PlannedTokenExchange",
        "PlannedTokenExchange",
    ]
    busy, balanced, recomputed = results[0][0], results[2][0], results[3][0]
    assert busy["0/at:blocks_end"]["act"] > balanced["0/at:blocks_end"]["act"]
    # (this tiny model's activations are mostly attention's: 17% less)
    assert recomputed["0/at:blocks_end"]["act"] < 0.9 * balanced["0/at:blocks_end"]["act"]


def test_expert_model_peak_is_the_same_from_any_two_depths_and_equals_the_whole_model(cache):
    """Two kinds of block grow the step: dense and MoE blocks are measured apart
    (``mem_phases.measured_depths``) and each phase extrapolated by both; from
    plan.layers_measured [1, 2] and [2, 3] the largest phase equals the tracker's own peak of
    the 6-block model (2 dense, 4 MoE) measured whole, within 5%."""
    whole_depth = (2, 4)
    pairs = {str(lm): mem_phases.measured_depths(lm, 6, 2) for lm in ([1, 2], [2, 3])}
    assert pairs["[1, 2]"] == [(1, 1), (1, 2), (2, 1)]
    depths = sorted({d for ds in pairs.values() for d in ds} | {whole_depth})
    got = dict(zip(depths, plan_memory.measure([_moe_request(d, ep=2) for d in depths])))
    whole = got[whole_depth]["peak"]["total"]
    for depths_of in pairs.values():
        phases = mem_phases.extrapolate({d: got[d] for d in depths_of}, whole_depth)
        assert abs(_largest_phase(phases) / whole - 1) <= 0.05, depths_of
        for got_part, want_part in zip(
            _pipeline_parts(phases), _pipeline_parts(got[whole_depth]["phases"])
        ):
            assert abs(got_part / want_part - 1) <= 0.05, depths_of


def test_expert_model_with_one_moe_block_extrapolates_its_interior_blocks(cache):
    """A model (or a pipeline stage) of dense blocks and a single MoE block, e.g. 3 dense and
    1 MoE: its interior blocks' backward is composed from both kinds' growth, so the MoE
    growth is measured although the model holds one MoE block; the largest phase equals the
    tracker's own peak of the 4-block model measured whole, within 5%."""
    whole_depth = (3, 1)
    depths_of = mem_phases.measured_depths([1, 2], 4, 3)
    depths = sorted(set(depths_of) | {whole_depth})
    got = dict(zip(depths, plan_memory.measure([_moe_request(d, ep=2) for d in depths])))
    phases = mem_phases.extrapolate({d: got[d] for d in depths_of}, whole_depth)
    assert abs(_largest_phase(phases) / got[whole_depth]["peak"]["total"] - 1) <= 0.05
