"""FGD across processes on the CPU (gloo): FSDP2 (row shards, fallbacks, checks, DCP), DDP, ZeRO.

Each case runs on 2 and 4 processes in float64 and is compared with one process running the
mean gradient on the whole model (tests/distributed_cases.py). Processes come from a
``forkserver`` with torch, FSDP2 and dynamo preloaded, so a case starts in well under a
second after the first; every join has a deadline, and the process group meets through a
file in a fresh temporary directory (no port to pick).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time

import pytest
import torch

import distributed_cases as cases
import fgd_fast

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)

TIMEOUT_S = 90  # per case; a hang fails the test instead of the CI job
TOL = 1e-12
_context = None


def _ctx():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(
            [
                "torch",
                "torch.distributed.fsdp",
                "torch.distributed.checkpoint",
                "torch._dynamo",
                "fgd_fast",
                "distributed_cases",
            ]
        )
    return _context


def run(world: int, case: str, **kwargs) -> list:
    """Run ``case`` on ``world`` processes; its per-rank results, or fail with the tracebacks."""
    ctx = _ctx()
    mutant = os.environ.get("FGD_TEST_MUTANT")  # tests/mutants.py: a collective's mutant, planted in each rank
    with tempfile.TemporaryDirectory() as out:
        init = "file://" + os.path.join(out, "rendezvous")
        procs = [
            ctx.Process(target=cases.entry, args=(r, world, init, out, case, kwargs, mutant), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r in range(world):
            path = os.path.join(out, f"rank{r}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else {"error": "no result"})
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    assert not errors, "\n".join(errors)
    assert not hung, f"ranks {hung} still running after {TIMEOUT_S} s"
    return [res["ok"] for res in results]


def assert_close(got: dict, want: dict, tol: float = TOL):
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= tol, f"{name}: max |Δ| = {err:.3g} > {tol}"


def assert_identical_ranks(results, key):
    for r, res in enumerate(results[1:], 1):
        for name, value in res[key].items():
            want = results[0][key][name]
            same = torch.equal(value, want) if isinstance(value, torch.Tensor) else value == want
            assert same, f"{key}[{name}] differs on rank {r}"


WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("placement", [True, False], ids=["shard_placement", "default_placement"])
def test_fsdp_matches_one_process(world, placement):
    results = run(world, "fsdp_steps", placement=placement)
    params, bufs, orth = cases.reference(5, world)
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert max(res["start_orth"].values()) < 1e-13  # orthogonalize_ on DTensors: the whole matrices
        assert res["orth"].keys() == orth.keys()
        for name in orth:  # the full matrices' distance (partial Grams + all-reduce, or gathered)
            assert abs(res["orth"][name] - orth[name]) <= TOL
            assert abs(res["dist"][name] - orth[name]) <= TOL
            assert res["orth"][name] < 1e-3  # θᵀθ ≈ I on the gathered matrices (O(η²‖g‖²) drift)
    assert_identical_ranks(results, "params")
    assert_identical_ranks(results, "orth")
    placements = results[0]["placements"]
    if placement:
        uneven_fc1 = 1 if world == 2 else 0  # 26 input features on 4 ranks: Shard(0), the fallback
        assert placements["conv.weight"] == 1 and placements["fc1.weight"] == uneven_fc1
        assert placements["stem.weight"] == placements["expand.weight"] == placements["odd.weight"] == 0
    else:
        assert set(placements.values()) == {0}
    for res in results:
        # the row shards' Gram blocks in one all-reduce, the owner path's checks in one more
        assert all(count == 2 for count in res["reduces"]), res["reduces"]
        # the other layers (stem, fc1 on 4 ranks; every layer without the placement) on the owner
        # path: θ, Φ, g (all float64) out in one all-to-all, θ₊ and Φ₊ back in another; where
        # their pieces lie was exchanged once, in the first step's only all-gather; nothing gathered
        assert all(count == 2 for count, _ in res["to_all"]), res["to_all"]
        assert res["gathers"] == [(1, 0)] + [(0, 0)] * 4, res["gathers"]
        assert res["said"] == []
    if placement and world == 2:
        # numbers summed per step: per row-sharded layer (conv, expand p = 12, fc1 p = 16, odd p = 2)
        # E and B whole, A, C and UᵀU as triangles, ‖g‖² (the first step, Φ = 0: E, A, G, ‖g‖²),
        # and the owner path's five checks of the stem and its owner's failure flag
        first = sum(p * p + p * (p + 1) + 1 for p in (12, 12, 16, 2)) + 6
        steady = sum(2 * p * p + 3 * p * (p + 1) // 2 + 1 for p in (12, 12, 16, 2)) + 6
        assert all(res["summed"] == [first] + [steady] * 4 for res in results), results[0]["summed"]


@pytest.mark.parametrize("world", WORLDS)
def test_the_guard_binding_on_one_row_sharded_layer_matches_one_process(world):
    """A ×3000 gradient on ``conv`` (row-sharded) at step 2: the guard binds there and nowhere
    else, from reduced inputs (‖g‖², tr C, E and UᵀU all summed over the ranks); a missing
    reduction of any of them would move the ranks off the single process."""
    spike = ("conv.weight", 2, 3000.0)
    results = run(world, "fsdp_steps", spike=spike)
    params, bufs, _ = cases.reference(5, world, spike=spike)
    want = cases.reference.guard_stats
    assert sum(v["scaled"] + v["reset"] for v in want.values()) == want["conv.weight"]["scaled"] >= 1
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert res["guard"] == want


@pytest.mark.parametrize("spike", [None, ("conv.weight", 2, 3000.0)], ids=["calm", "guard-binds"])
def test_float32_row_shards_match_one_process(monkeypatch, spike):
    """float32 parameters: the same step as one process to float32 rounding (the partial Grams
    and UᵀU summed in another order), the guard's inputs reduced alike: with a spike, the guard
    scales from the ranks' summed ‖g‖² (float64 values that travel folded into float32 pairs)."""
    results = run(2, "fsdp_steps", dtype=torch.float32, spike=spike)
    monkeypatch.setattr(cases, "DTYPE", torch.float32)
    params, bufs, orth = cases.reference(5, 2, spike=spike)
    want = cases.reference.guard_stats
    assert (want["conv.weight"]["scaled"] >= 1) == (spike is not None)
    for res in results:
        assert_close(res["params"], params, tol=2e-6)
        assert_close(res["bufs"], bufs, tol=2e-6)
        assert res["guard"] == want
        # the float32 blocks and the float64 ‖g‖² sums (folded into float32 pairs) in one all-reduce
        # (and the stem's owner-path checks in the other)
        assert all(count == 2 for count in res["reduces"]), res["reduces"]


def test_buckets_of_gram_blocks_are_summed_while_the_next_grams_are_made():
    """With a bucket size below one group's blocks, every Gram group's blocks leave in their own
    asynchronous all-reduce(s) as soon as they are made, before the next group's Grams: the
    communication overlaps the Gram pass, and the step is still the single process's."""
    results = run(2, "fsdp_steps", bucket_bytes=1)
    params, bufs, orth = cases.reference(5, 2)
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        kinds = [kind for kind, _ in res["events"]]
        assert kinds.count("reduce") >= kinds.count("gram") >= 2, kinds  # a call (or more: 1-byte buckets) per group
        assert kinds.index("reduce") < len(kinds) - 1 - kinds[::-1].index("gram"), kinds  # before the last Grams
        assert res["events"][-1] == ("reduce", False)  # the stem's owner-path checks, after every Gram
        assert all(asynchronous for kind, asynchronous in res["events"][:-1] if kind == "reduce")


def test_sharding_gather_steps_row_shards_whole_and_exactly():
    """``sharding="gather"``: every layer, the row-sharded ones too, is gathered (one packed
    all-gather, no Gram all-reduce, no all-to-all) and stepped whole; the step is still the
    single process's, the guard's verdicts too (it binds on the row-sharded conv at step 2: the
    gathered step's guard codes reach the ranks' statistics), and no warning (gathering was
    asked for)."""
    spike = ("conv.weight", 2, 3000.0)
    results = run(2, "fsdp_steps", sharding="gather", spike=spike)
    params, bufs, orth = cases.reference(5, 2, spike=spike)
    want = cases.reference.guard_stats
    assert want["conv.weight"]["scaled"] + want["conv.weight"]["reset"] >= 1
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert res["guard"] == want
        assert all(count == 0 for count in res["reduces"]) and all(g == (1, 0) for g in res["gathers"])
        assert all(count == 0 for count, _ in res["to_all"]) and res["said"] == []


def test_sharding_owner_sends_row_shards_to_owners_too():
    """``sharding="owner"``: every layer, row shards included, stepped whole on its owner (no
    Gram all-reduce: one all-reduce of the checks, two all-to-alls), as one process would."""
    results = run(2, "fsdp_steps", sharding="owner")
    params, bufs, orth = cases.reference(5, 2)
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert all(count == 1 for count in res["reduces"]) and all(c == 2 for c, _ in res["to_all"])
        assert res["gathers"][1:] == [(0, 0)] * 4 and res["said"] == []


def test_hsdp_reduces_over_the_shard_dimension():
    results = run(4, "fsdp_steps", hsdp=True)  # 2 replicas × 2 shards
    params, bufs, orth = cases.reference(5, 4)
    for res in results:
        # the distances before any step: the row shards' Grams summed over the shard dimension
        # only (summed over the replicas too, θᵀθ would be 2I: a distance of √2·√p)
        assert max(res["start_orth"].values()) < 1e-13, res["start_orth"]
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        for name in orth:
            assert abs(res["orth"][name] - orth[name]) <= TOL
        # the row shards' blocks over the shard dimension; the stem (columns sharded) on the owner
        # path within each replica's shard group too (the traffic stays there), its checks summed
        assert all(count == 2 for count in res["reduces"]) and all(c == 2 for c, _ in res["to_all"])
        assert res["said"] == []
    assert_identical_ranks(results, "params")
    # numbers sent per step, all ranks: in each of the 2 shard groups the stem's (8 × 3 × 3 × 3)
    # θ, g (and Φ after the first step) to its owner, θ₊ and Φ₊ back
    stem = 8 * 3 * 3 * 3
    sent = [sum(res["to_all"][step][1] for res in results) for step in range(5)]
    assert sent == [2 * 4 * stem] + [2 * 5 * stem] * 4, sent
    assert results[0]["placements"]["conv.weight"] == 1  # (Replicate(), Shard(1))


@pytest.mark.parametrize("world", [2])
def test_fsdp_reference_backend_steps_every_layer_on_its_owner(world):
    """A backend without row shards: every layer on the owner path (no Gram all-reduce, one
    all-reduce of the checks), nothing gathered after the first step's layout exchange."""
    results = run(world, "fsdp_steps", backend="reference")
    params, bufs, _ = cases.reference(5, world, backend="reference")
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert all(count == 1 for count in res["reduces"]) and all(c == 2 for c, _ in res["to_all"])
        assert res["gathers"] == [(1, 0)] + [(0, 0)] * 4 and res["said"] == []


@pytest.mark.parametrize("world", WORLDS)
def test_tensor_parallel_layers_step_on_their_owners_exactly(world):
    """ColwiseParallel splits θ's columns, RowwiseParallel θ = W2's (2 columns: a rank with
    none on 4): both stepped on their owners, as one process would, with nothing gathered after
    the first step's layout exchange and no warning."""
    results = run(world, "tp_steps")
    params, bufs, orth = cases.reference(5, world)
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        for name in orth:
            assert abs(res["orth"][name] - orth[name]) <= TOL
        assert res["placements"]["fc1.weight"] == "(Shard(dim=0),)"  # W's rows: θ = W2ᵀ's columns
        assert all(count == 2 for count, _ in res["to_all"]) and res["said"] == []
        assert res["gathers"] == [(1, 0)] + [(0, 0)] * 4, res["gathers"]
    assert_identical_ranks(results, "params")
    # numbers sent per step, all ranks together (their own parts included): every piece of θ, g
    # and Φ once to the owners and θ₊, Φ₊ back, fc1 (16 × 26) and odd (3 × 2); a first step's Φ
    # is zero and stays home
    sizes = 16 * 26 + 3 * 2
    sent = [sum(res["to_all"][step][1] for res in results) for step in range(5)]
    assert sent == [4 * sizes] + [5 * sizes] * 4, sent


def test_fsdp_over_tensor_parallel_on_a_2d_mesh_steps_exactly():
    """FSDP2 (dp) over tensor parallel (tp) on a 2 × 2 mesh: fc1's (_StridedShard, Shard) and
    odd's (Shard(0), Shard(1)) go to owners over all 4 ranks (the strided placement checked once
    against the gathered tensor), the convolutions take their paths within each dp group; the
    guard binds on the 2-D layer fc1 at step 2 alone, from the whole matrix on its owner."""
    spike = ("fc1.weight", 2, 3000.0)
    results = run(4, "tp_steps", fsdp=True, spike=spike)
    params, bufs, orth = cases.reference(5, 4, spike=spike)
    want = cases.reference.guard_stats
    assert want["fc1.weight"]["scaled"] + want["fc1.weight"]["reset"] >= 1
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert res["guard"] == want
        assert "_StridedShard" in res["placements"]["fc1.weight"], res["placements"]
        assert res["placements"]["odd.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert res["said"] == []
        assert all(g == (0, 0) for g in res["gathers"][1:]), res["gathers"]
    assert_identical_ranks(results, "params")


def test_sharding_gather_on_fsdp_over_tensor_parallel_steps_exactly():
    """``sharding="gather"`` on the 2 × 2 (dp, tp) mesh: 2-D placements (fc1's strided one
    included) are gathered as DTensor gathers them, not packed as FSDP2's 1-D shards are; the
    steps and the guard's verdicts are one process's."""
    spike = ("fc1.weight", 2, 3000.0)
    results = run(4, "tp_steps", fsdp=True, spike=spike, sharding="gather")
    params, bufs, _ = cases.reference(5, 4, spike=spike)
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert res["guard"] == cases.reference.guard_stats
        assert res["said"] == [] and all(count == 0 for count, _ in res["to_all"])
    assert_identical_ranks(results, "params")


def test_a_layout_table_that_misplaces_a_strided_shard_sends_the_layer_to_the_gather():
    """The owner path's table of where each rank's piece lies comes from torch's shard geometry;
    for placements other than ``Shard``/``Replicate`` (FSDP over TP's ``_StridedShard``) it is
    checked once against the pieces themselves. A geometry that misplaces them (here: the strided
    shard taken as a plain one; tiles θ, wrong boxes) is caught: fc1 is gathered every step and
    said, and the steps stay exact."""
    spike = ("fc1.weight", 2, 3000.0)
    results = run(4, "tp_steps", fsdp=True, spike=spike, lying_table=True)
    params, bufs, _ = cases.reference(5, 4, spike=spike)
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
        assert len(res["said"]) == 1 and "(16, 26)" in res["said"][0], res["said"]
        # every step: fc1's θ, Φ and g gathered whole (nothing at all with the true geometry)
        assert all(g == (0, 3) for g in res["gathers"][1:]), res["gathers"]


def test_compiled_step_under_fsdp_matches_one_process():
    """Why 5: ``torch.compile(opt.step)`` failed under FSDP2 (dynamo inside DTensor code; a
    traced ``zeros_like`` gave the uneven shard of a first step's Φ the wrong local shape)."""
    params, bufs, _ = cases.reference(3, 2)
    for res in run(2, "fsdp_compiled"):  # row shards (uneven: odd) and owner layers (stem)
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)


@pytest.mark.parametrize("sharding", ["rows", "owner", "gather"])
def test_a_step_that_would_leave_the_manifold_is_refused_on_every_path(sharding):
    results = run(2, "fsdp_step_beyond_the_limit", sharding=sharding)
    for res in results:
        assert res["unchanged"] == [True] and "conv.weight" in res["messages"][0], res["messages"]


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_training_matches_mean_gradient(world):
    results = run(world, "fsdp_train")
    params, bufs, _ = cases.reference(5, world, mode="train")
    for res in results:
        assert_close(res["params"], params)
        assert_close(res["bufs"], bufs)
    assert_identical_ranks(results, "params")


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_refusal_is_collective(world):
    results = run(world, "fsdp_refusals")
    for res in results:
        assert all(res["unchanged"]), res["unchanged"]
        assert res["messages"] == results[0]["messages"]
    msgs = results[0]["messages"]
    for msg, name in zip(msgs, ("conv.weight", "expand.weight", "stem.weight")):
        assert "non-finite gradient" in msg and repr(name) in msg
    assert "'conv.weight'" in msgs[3] and "from the Stiefel manifold" in msgs[3]


def test_fsdp_on_a_mesh_over_some_ranks_agrees_within_it():
    """A distributed review: the ranks' agreement ran on the whole world, so FSDP2 on a mesh over
    ranks 0 and 1, beside another stage on rank 2, hung (or raised a false disagreement). Each
    mesh now agrees within itself; ranks 0 and 1 step as one process does."""
    results = run(3, "fsdp_submesh")
    params, _, _ = cases.reference(2, 2)
    for res in results[:2]:
        assert res["first"]
        assert_close(res["params"], params)
    assert not results[2]["first"] and all(torch.isfinite(p).all() for p in results[2]["params"].values())


def test_ranks_that_disagree_raise_alike_instead_of_diverging_or_hanging():
    """Why 5: another lr or feedback on one rank diverged silently, another momentum or check
    flag aborted, another backend hung to the timeout."""
    results = run(2, "fsdp_disagreements")
    for res in results:
        assert all(res["unchanged"]), res["unchanged"]
        assert res["messages"] == results[0]["messages"]
    assert len(results[0]["messages"]) == 15
    for msg, what in zip(
        results[0]["messages"],
        (
            "lr",
            "lr",  # (one rank at lr = 0)
            "feedback",
            "momentum",
            "check_finite",
            "backend",
            "sharding",
            "check_manifold",
            "max_distance",
            "guard",
            "trust_radius",
            "variant",
            "maximize",
            "backend",  # (auto, resolved to another backend on one rank)
            "lr",
        ),
    ):
        assert f"the ranks disagree on {what}" in msg, msg


@pytest.mark.parametrize("world", [2, 3])
def test_a_check_failing_on_one_ranks_unsharded_layer_stops_every_rank(world):
    """A review: the ranks whose own checks passed wrote their unsharded layers, then waited in
    the sharded layers' exchange for the rank that had raised (a hang, and weights apart)."""
    results = run(world, "fsdp_plain_check_on_one_rank")
    assert all(res["unchanged"] for res in results)
    assert results[-1]["raised"] == "FloatingPointError" and "conv.weight" in results[-1]["message"]
    for res in results[:-1]:
        assert res["raised"] == "ValueError" and "passed the checks" in res["message"], res["message"]


def test_a_group_mixing_dtensor_and_plain_parameters_steps_exactly():
    results = run(2, "fsdp_partial")
    params, _, _ = cases.reference(3, 2)
    for res in results:
        assert_close(res["params"], params)


def test_orthogonality_on_one_rank_needs_no_collective():
    results = run(2, "fsdp_orthogonality_on_one_rank")
    one, fresh = results[0]["one"], results[0]["fresh"]
    assert one.keys() == fresh.keys() == set(cases.ORTHOGONAL)
    for name in one:  # the step's exact distance against a fresh measurement of the stored θ
        assert abs(one[name] - fresh[name]) <= 1e-12
    assert results[1]["one"] is None and results[1]["fresh"] == fresh
    rested = results[0]["rested"]  # (after a step at lr = 0: still no collective, nothing moved)
    assert rested == one and results[0]["after_rest"] == fresh


def test_a_gradient_on_one_rank_only_of_an_unsharded_layer_steps():
    """A review of the check-verdict agreement: a rank without gradients for the unsharded
    layers skipped it, mismatching the others' collectives (gloo: "collective mismatch")."""
    results = run(2, "fsdp_grad_on_one_rank")
    assert results[0]["distance"][1] == results[1]["distance"][1]  # (the sharded layer; the other is each rank's own)
    assert results[0]["distance"][0] != results[1]["distance"][0]  # (stepped on rank 0 only)


def test_a_rank_without_gradients_for_its_sharded_layers_raises_with_the_others():
    """A review: a rank whose orthogonal DTensors all had grad=None skipped the ranks'
    agreement and the others hung in it; now every rank raises the same error (the layer
    count) before writing, and a step where every rank lacks them rests those layers."""
    results = run(2, "fsdp_dtensor_grads_none_on_one_rank")
    for r in results:
        assert len(r["messages"]) == 1 and "the number of sharded orthogonal parameters" in r["messages"][0]
        assert r["unchanged"] == [True] and r["rested"] and r["moved"]
    assert results[0]["messages"] == results[1]["messages"]


@pytest.mark.parametrize("world, kind", [(2, "swap"), (4, "submesh")])
def test_ranks_with_gradients_for_different_sharded_layers_raise_alike(world, kind):
    """A diff review: ranks stepping different sharded layers (the same count) passed the
    agreement and summed different layers' Grams; ranks on several meshes agreed on them in
    different orders, or waited on a wider mesh for ranks that had raised on a sub-mesh (a hang).
    Every rank raises now, before writing."""
    results = run(world, "fsdp_mismatched_gradients", kind=kind)
    for r in results:
        assert r["message"] is not None and r["unchanged"], r
    named = [r for r in results if "the sharded orthogonal parameters" in r["message"]]
    assert named and all("disagree" in r["message"] for r in results)


def test_layers_whose_gradient_or_momentum_has_another_layout_are_gathered_exactly_and_said():
    """A gradient, or a (loaded) momentum buffer, placed otherwise than its row-sharded parameter
    fits neither the row all-reduce nor the owner path: the layer is gathered and stepped whole,
    as one process steps it, and a warning names it (once per set of such layers)."""
    results = run(2, "fsdp_other_layouts")
    for res in results:
        assert res["diff"] < TOL and res["buf"] < TOL, res
        assert len(res["said"]) == 2, res["said"]  # layer 0 from the first step; both from the second
        assert res["said"][0].startswith("FGD all-gathers 1 sharded parameter(s)") and "(32, 8)" in res["said"][0]
        assert res["said"][1].startswith("FGD all-gathers 2 sharded parameter(s)")


def test_a_local_check_failing_on_a_submesh_rank_raises_on_every_rank():
    """A review: the ranks' agreement on the unsharded layers' checks raised at the first
    mesh that disagreed, so the ranks of another sub-mesh waited on the whole mesh (a hang);
    the disagreement is carried into the wider mesh now. Every rank raises, nothing is written;
    the rank whose gradient was NaN raises its own error."""
    results = run(4, "fsdp_local_check_on_a_submesh")
    for r in results:
        assert r["message"] is not None and r["unchanged"], r
    assert "FloatingPointError" in results[-1]["message"] or "finite" in results[-1]["message"], results[-1]
    assert all("disagree" in r["message"] for r in results[:-1]), results


@pytest.mark.parametrize("kind", ["submesh-rows", "submesh-cols", "hsdp-nan", "hsdp-off"])
def test_a_sharded_check_failed_on_part_of_the_ranks_stops_every_rank(kind):
    """An ownership review: a sharded layer's checks are shared within its own group (a 2-rank
    sub-mesh, HSDP's shard dimension), so a failure there left the other ranks writing — half a
    step of a row-sharded layer, the other HSDP replica stepped — or waiting in the owner path's
    all-to-all (a hang). With several meshes, or a mesh of more than one dimension, the ranks agree
    on the verdict first: every rank raises and nothing is written anywhere."""
    results = run(4, "fsdp_sharded_check_on_part_of_the_ranks", kind=kind)
    for r in results:
        assert r["message"] is not None and r["unchanged"], results
    assert all("disagree" in r["message"] or "finite" in r["message"] or "θᵀθ" in r["message"] for r in results)


@pytest.mark.parametrize("plain", [False, True], ids=["sharded", "plain-beside-sharded"])
def test_a_backend_that_loads_on_some_ranks_only_fails_on_every_rank(plain):
    """An ownership review: an explicit backend that cannot load on one rank raised there before
    the ranks' first collective, and the other ranks waited in it (the process group's timeout).
    The rank holds its error until the agreement: it raises its own, the others raise with it."""
    results = run(2, "fsdp_backend_on_some_ranks", plain=plain)
    assert all(r["message"] is not None and r["unchanged"] for r in results), results
    assert results[-1]["message"].startswith("BackendUnavailable"), results
    assert "could prepare its step" in results[0]["message"], results


@pytest.mark.parametrize("world, hsdp", [(2, False), (4, True)], ids=["fsdp", "hsdp"])
def test_a_failure_on_the_owner_rank_stops_every_rank(world, hsdp):
    """An ownership review: the owner path's owner holds whole matrices; a failure there (out of
    memory) raised on the owner alone and left the other ranks waiting in a collective. The
    checks' all-reduce carries it to its group; under HSDP (the owner path within each shard
    group) the ranks' agreement carries it to the other replica. Every rank raises, nothing is
    written."""
    results = run(world, "fsdp_owner_fails", hsdp=hsdp)
    assert all(r["message"] is not None and r["unchanged"] for r in results), results
    assert sum("can't allocate memory" in r["message"] for r in results) == 1, results
    assert sum("could not step 1 parameter(s) on the owner path" in r["message"] for r in results) == 1, results
    if hsdp:  # (the other replica: the ranks disagree on the verdict)
        assert sum("a check failed, or a step could not be prepared" in r["message"] for r in results) == 2


def test_the_owner_steps_without_the_received_pieces():
    """A memory review: the owner held its layers' received pieces (θ, g, Φ once more) through its
    whole-matrix step; they are released before it, and the steps match one process."""
    for res in run(2, "owner_step_without_received"):
        assert res["error"] < 1e-12, res


def test_owner_layout_tables_follow_dimensions_and_placements():
    """On the owner path: a Linear listed before a convolution, then layers of the same shapes
    placed otherwise, in a second optimizer: each steps as one process would."""
    for res in run(2, "owner_layouts"):
        for steps in res:
            for got, want in zip(steps["got"], steps["want"]):
                assert (got - want).abs().max() <= TOL


def test_a_2d_mesh_over_some_ranks_steps_and_agrees_within_itself():
    """A 1 × 2 mesh over ranks 0, 1 beside a 1 × 1 mesh over rank 2 (another lr): a layer sharded
    along both dimensions (gathered within the mesh) and an HSDP-like one (owner path within the
    shard group) step exactly; ranks 0, 1 disagreeing on lr both raise and write nothing."""
    results = run(3, "submesh_2d")
    for rank, res in enumerate(results):
        for got, want in zip(res["got"], res["want"]):
            assert (got - want).abs().max() <= TOL, rank
        if rank < 2:
            assert "the ranks disagree on lr" in res["message"] and res["unchanged"], res["message"]


def test_replicated_pieces_travel_to_the_owner_once():
    """A strided shard replicated along the other mesh dimension (2 × 2): the owner path over
    all ranks, two holders per piece. Only each piece's first holder sends it (ranks 2 and 3
    send nothing); θ₊, Φ₊ return to all four; the steps are one process's, exactly."""
    results = run(4, "owner_replicated_pieces")
    n = 26 * 16
    for res in results:
        assert torch.equal(res["theta"], res["ref_theta"]) and torch.equal(res["phi"], res["ref_phi"])
        assert all(calls == 2 and whole == 0 for calls, _, _, whole in res["sent"]), res["sent"]
    assert [res["sent"][0][1] for res in results[2:]] == [0, 0] and [res["sent"][1][1] for res in results[2:]] == [0, 0]
    # all ranks: θ, g (and Φ after the first step) once to the owner; θ₊, Φ₊ to the 4 holders of halves
    totals = [sum(res["sent"][step][1] for res in results) for step in range(3)]
    assert totals == [2 * n + 2 * 4 * n // 2] + [3 * n + 2 * 4 * n // 2] * 2, totals


@pytest.mark.parametrize(
    "kwargs", [{}, dict(sharding="gather", float32_first=True)], ids=["rows", "gathered_float32_first"]
)
def test_a_float64_row_shard_beside_a_float32_one_is_summed_in_float64(kwargs):
    """An ownership review: the float64 layer's Gram blocks rode folded in the float32 all-reduce
    (4.9e-9 from one process after 20 steps). Only per-layer scalars fold now; the float64 layer
    matches one process to float64 rounding. Gathered, each dtype has its own all-gather (the
    float64 shards never ride in the float32 layer's message)."""
    for res in run(2, "rows_float64_beside_float32", **kwargs):
        assert (res["theta"] - res["ref_theta"]).abs().max() <= 1e-14, (res["theta"] - res["ref_theta"]).abs().max()
        assert (res["phi"] - res["ref_phi"]).abs().max() <= 1e-14


def test_a_nan_in_a_strided_shard_at_the_first_step_does_not_cost_the_owner_path_for_good():
    """An ownership review: a NaN in an FSDP-over-TP shard at the first step made the layout check
    (by values) say the pieces were not where the table said; the verdict was kept, so after the
    repair the layer was all-gathered every step. The check is by positions now."""
    for res in run(4, "tp_nan_at_the_first_step"):
        assert res["messages"][0] is not None and res["messages"][1:] == [None, None], res["messages"]
        assert res["said"] == [] and res["gathers"][1:] == [0, 0], res  # (the first: reset_parameter)
        assert res["orth"] < 1e-3


@pytest.mark.parametrize("what", ["buffer", "plain", "lr", "plain_weight_decay"])
def test_a_buffer_that_does_not_fit_on_one_rank_stops_every_rank(what):
    """A diff review: an orthogonal layer's momentum buffer (refused in ``fgd()``) or a plain
    bias's (refused by ``FGD.step`` itself) that does not fit on one rank only left the others
    waiting in the ranks' first collective; the refusing rank joins the agreement with its error.
    So does a hyper-parameter refused on one rank only (a review: it was checked before)."""
    results = run(2, "fsdp_buffer_unfit_on_one_rank", what=what)
    assert all(r["message"] is not None and r["unchanged"] for r in results), results
    own = {"lr": "invalid lr=-0.1", "plain_weight_decay": "invalid weight_decay=-1.0"}.get(what, "momentum_buffer is")
    assert own in results[-1]["message"], results
    assert "could not be prepared" in results[0]["message"], results


@pytest.mark.parametrize("what", ["phi_nan", "phi_inf"])
def test_a_non_finite_momentum_in_one_ranks_rows_stops_every_rank(what):
    """A failure-injection review: a NaN or Inf in one rank's rows of Φ made the summed tr C
    non-finite on every rank, and each rank then took ‖Φ‖² from its own rows (to tell a huge
    finite Φ from a non-finite one): the other ranks found theirs finite and stepped, the one
    holding the NaN raised. Those sums are taken over the ranks now: every rank refuses."""
    results = run(2, "fsdp_buffer_unfit_on_one_rank", what=what)
    assert all(r["message"] is not None and "non-finite" in r["message"] for r in results), results
    assert all(r["unchanged"] for r in results), results


@pytest.mark.parametrize("what", ["nokey", "lr"])
def test_a_load_whose_groups_are_refused_on_one_rank_is_refused_on_every_rank(what):
    """A failure-injection review: the outline and hyper-parameter checks of a load ran before
    the ranks' agreement; a refusal on one rank left the others waiting (the process group's
    timeout). Every rank raises now, the refusing one its own error, and none loads."""
    results = run(2, "fsdp_load_refused_on_one_rank", what=what)
    assert all(r["message"] is not None and r["refused_whole"] for r in results), results
    assert "another rank refused" in results[0]["message"], results
    assert ("no 'feedback'" if what == "nokey" else "invalid lr") in results[-1]["message"], results


def test_a_dcp_load_refused_on_one_rank_is_refused_on_every_rank():
    """A checkpoint review: a NaN in one rank's shard of Φ was refused by that rank alone (the
    finiteness check read the local shard); every rank refuses now, naming the cause on the rank
    that holds it, and none loads anything."""
    results = run(2, "dcp_load_with_a_nan_in_one_shard")
    assert "NaN/Inf" in results[0]["message"], results[0]
    assert "another rank refused" in results[1]["message"], results[1]
    assert all(r["refused_whole"] and r["loaded_after"] for r in results), results


def test_orthogonality_after_compiled_or_outside_writes_is_measured():
    """A review: a DTensor parameter stepped eagerly once, then by compiled steps, kept
    reporting the eager step's distance (the compiled step records none). The recorded
    distance is used only while the parameter's version counters are the step's (one
    process on gloo: the bookkeeping is per rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        p = torch.nn.Parameter(distribute_tensor(fgd_fast.orthogonalize_(torch.randn(12, 5)), mesh, [Shard(0)]))
        opt = fgd_fast.FGD([dict(params=[p], orthogonal=True)], lr=0.3, backend="torch")

        def step(run):
            p.grad = distribute_tensor(torch.randn(12, 5), mesh, [Shard(0)])
            run()
            return opt.orthogonality()[0], opt.orthogonality(fresh=True)[0]

        told, fresh = step(opt.step)
        assert told == pytest.approx(fresh, rel=1e-4)  # (the step's own exact distance)
        for _ in range(2):
            told, fresh = step(torch.compile(opt.step))
            assert told == fresh
        told, fresh = step(opt.step)
        with torch.no_grad():
            p.mul_(1.01)  # a write outside the step
        assert opt.orthogonality()[0] == opt.orthogonality(fresh=True)[0] != told
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_first", [False, True], ids=["optimizer_first", "model_first"])
def test_fsdp_checkpoint_round_trip(model_first):
    results = run(2, "fsdp_checkpoint", model_first=model_first)
    for res in results:
        assert res["identical"]
        assert res["names"] == sorted(
            cases.ORTHOGONAL + ("fc2.weight",) + tuple(f"{m}.bias" for m in ("stem", "conv", "expand", "fc1", "fc2"))
        )
        straight, resumed = res["counts"]  # (the guard's counters: the resumed state had lost them)
        assert resumed == straight and all(c == {"scaled": 3, "reset": 1} for c in straight.values()), res["counts"]


def test_fsdp_checkpoint_saved_on_2_ranks_resumes_on_4(tmp_path):
    """DCP reshards: a checkpoint saved by 2 ranks, loaded by 4 (other placements: fc1 is
    gathered there) continues the run that never stopped, to float64 rounding."""
    path = str(tmp_path / "ckpt")
    straight = run(2, "fsdp_save", path=path)[0]
    for res in run(4, "fsdp_resume", path=path):
        assert_close(res["params"], straight["params"])
        assert_close(res["bufs"], straight["bufs"])


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_ranks_bit_identical(world):
    results = run(world, "ddp_train")
    params, _, _ = cases.reference(5, world, mode="train")
    assert_identical_ranks(results, "params")
    assert_close(results[0]["params"], params)


@pytest.mark.parametrize("world", WORLDS)
def test_zero_labels_and_consolidated_state(world):
    results = run(world, "zero_steps")
    params, bufs, orth = cases.reference(5, world)
    owned = []
    for res in results:
        assert_close(res["params"], params)
        # each rank names the orthogonal parameters it owns, with their own distances
        mine = [n for n in res["owned"] if n in cases.ORTHOGONAL]
        assert sorted(res["orth"]) == sorted(mine)
        for name in mine:
            assert abs(res["orth"][name] - orth[name]) <= TOL
        owned += res["owned"]
    assert sorted(owned) == sorted(params)  # every parameter has exactly one owner
    state = results[0]["state"]
    model = cases.build()
    opt = fgd_fast.FGD(fgd_fast.stiefel_param_groups(model, cases.rule), **cases.HYPER)
    opt.load_state_dict(state)  # the consolidated state is a whole-model FGD state dict
    names = [n for g in opt.param_groups for n in g["names"]]
    for p, name in zip((p for g in opt.param_groups for p in g["params"]), names):
        assert torch.allclose(opt.state[p]["momentum_buffer"], bufs[name], rtol=0, atol=TOL)


def test_shard_placement_rules():
    from torch.distributed.tensor import Shard

    conv = torch.empty(12, 8, 3, 3)
    assert fgd_fast.shard_placement(conv, world_size=4) == Shard(1)  # θ = W2ᵀ: rows are c_i·k·k
    assert fgd_fast.shard_placement(torch.empty(16, 3, 4, 4), world_size=2) == Shard(2)  # c_i uneven, k even
    assert fgd_fast.shard_placement(torch.empty(16, 3, 3, 3), world_size=2) == Shard(0)  # nothing even: fallback
    assert fgd_fast.shard_placement(torch.empty(64, 16, 1, 1), world_size=8) == Shard(0)  # θ = W2: rows are c_o
    assert fgd_fast.shard_placement(torch.empty(10, 16), world_size=4) == Shard(1)
    assert fgd_fast.shard_placement(torch.empty(10), world_size=4) is None


def test_row_shards_are_whole_rows_of_theta_with_every_other_mesh_dimension_replicating():
    """Which DTensor placements the row all-reduce takes (the mesh dimension that splits θ's
    rows), from the placements alone: θ = W2ᵀ (c_o ≤ m) is split into rows by Shard(d ≥ 1),
    θ = W2 by Shard(0); one sharded mesh dimension, every other one replicating (HSDP)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard

    from fgd_fast.distributed import row_mesh_dim

    def dim(shape, *placements):
        return row_mesh_dim(SimpleNamespace(shape=torch.Size(shape), placements=placements, dim=lambda: len(shape)))

    wide, tall = (16, 64), (64, 16)  # θ = W2ᵀ (rows along dim 1), θ = W2 (rows along dim 0)
    assert dim(wide, Shard(1)) == 0 and dim(wide, Shard(-1)) == 0 and dim(tall, Shard(0)) == 0
    assert dim(wide, Replicate(), Shard(1)) == 1  # HSDP
    assert dim(wide, Shard(0)) is None and dim(tall, Shard(1)) is None  # θ's columns
    assert dim(wide, Shard(1), Shard(0)) is None and dim(wide, Replicate()) is None
    assert dim(wide, Shard(1), Partial()) is None  # a pending sum is not a replica


def test_float64_sums_folded_into_float32_pairs_survive_the_sum():
    """The guard's float64 ‖g‖² ride in the float32 all-reduce as scaled [hi, lo] pairs: the sum
    over ranks of the pairs decodes to the float64 sum to ~1e-7; beyond float32's range (after
    the 2⁻⁶⁴ scale) a value becomes inf, as an overflowing float64 ‖g‖² does; NaN stays NaN."""
    from fgd_fast.distributed import fold_float64, unfold_float64

    gen = torch.Generator().manual_seed(0)
    ranks = [
        torch.rand(64, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-20, 57, (64,), generator=gen)
        for _ in range(3)
    ]
    summed = sum(fold_float64(x) for x in ranks)  # as a float32 all-reduce adds them (in some order)
    want = sum(ranks)
    assert torch.allclose(unfold_float64(summed), want, rtol=3e-7, atol=1e-25)
    edge = torch.tensor([0.0, 1e-30, 2e57, 1e60, float("inf"), float("nan")], dtype=torch.float64)
    got = unfold_float64(fold_float64(edge) + fold_float64(edge))
    assert got[0] == 0 and abs(float(got[1])) < 1e-25 and got[2] == pytest.approx(4e57, rel=1e-7)
    assert torch.isinf(got[3]) and torch.isinf(got[4]) and torch.isnan(got[5])
    # one rank's pair (or a sum with the others' zeros) decodes to its float64 value: hi carries
    # float32's 24 bits, lo the next 24 (a pair without lo, or decoded without it, keeps ~6e-8)
    alone = torch.rand(64, generator=gen, dtype=torch.float64) * torch.logspace(-10, 30, 64, dtype=torch.float64)
    assert torch.allclose(unfold_float64(fold_float64(alone)), alone, rtol=1e-14, atol=0)
    with_zeros = fold_float64(alone) + fold_float64(torch.zeros_like(alone))
    assert torch.allclose(unfold_float64(with_zeros), alone, rtol=1e-14, atol=0)


def test_sums_over_ranks_by_dtype():
    """``summing_over``'s packed all-reduce: float64 scalars alone are summed in float64, beside
    float32 tensors they ride folded in the float32 call (~1e-7), beside a float64 layer's Gram
    blocks they stay in its float64 call; every sum lands in its own tensor."""
    for res in run(2, "sums_by_dtype"):
        for got, want, rel in res:
            assert got.dtype == want.dtype and torch.allclose(got, want, rtol=rel, atol=0), (got, want)


def test_packed_collectives_fill_each_call_up_to_the_cap():
    """The packed all-reduces and all-gathers cut their tensors into consecutive runs of at most
    the cap in bytes, each run as full as it can be (a run of exactly the cap is one call), and a
    tensor larger than the cap travels alone."""
    from fgd_fast.collectives import packed

    size = lambda x: x  # noqa: E731
    assert packed([1, 1], size, 2) == [[1, 1]]  # exactly the cap: one call
    assert packed([1, 2, 1], size, 3) == [[1, 2], [1]]
    assert packed([5, 1, 1], size, 2) == [[5], [1, 1]]  # past the cap: alone
    assert packed([], size, 2) == []


def test_auto_sharding_sums_tall_row_shards_and_sends_the_rest_to_owners():
    """``sharding="auto"``'s choice (bytes at the busiest rank per step): on few ranks a
    convolution (n = 9p) and an MLP weight (n = 4p) stay summed, square projections go to
    owners; on more ranks a lone convolution stays (its owner would receive it whole) while
    many spread over the ranks move; small layers stay summed (< 1 MiB saved)."""
    from fgd_fast.distributed import moved_to_owners, path_bytes
    from fgd_fast.owners import busiest_bytes

    def layer(*shape):
        return torch.empty(shape, device="meta")

    def moved(shapes, ranks, owned=()):
        return moved_to_owners([(layer(*s), layer(*s)) for s in shapes], [(layer(*s), layer(*s)) for s in owned], ranks)

    assert moved([(512, 512, 3, 3)] * 8, 4) == () and moved([(3072, 768)] * 8, 2) == ()  # tall, few ranks
    assert moved([(768, 768)] * 12, 8) == tuple(range(12))  # a Transformer's projections
    conv = (512, 512, 3, 3)  # on 16 ranks: 6.6 MB summed, 26.5 MB into the owner of one
    assert moved([conv], 16) == () and moved([conv] * 16, 16) == tuple(range(16))  # alone no, spread yes
    assert moved([(768, 768)], 8) == (0,)  # square: its owner receives 6.2 MB, 13.8 MB summed
    assert moved([(64, 64)] * 4, 64) == ()  # < 1 MiB saved: stays summed
    # 1.7 MiB saved: not worth the owner path's own collectives, worth it where they run anyway
    assert moved([(384, 384)], 4) == () and moved([(384, 384)], 4, owned=[(16, 16)]) == (0,)
    # the busiest rank's bytes on the owner path (float32 θ, g, Φ: 12 bytes an entry out, 8 back)
    pair = (layer(768, 768), layer(768, 768))
    assert busiest_bytes([pair], 4) == 0.75 * 12 * 768**2  # the owner receives 3/4 of θ, g, Φ whole
    # two owners on 2 ranks: half of its own layer's θ, g, Φ in, half of the other's θ₊, Φ₊ back
    assert busiest_bytes([pair] * 2, 2) == (0.5 * 12 + 0.5 * 8) * 768**2
    cost = path_bytes(layer(4096, 1024), layer(4096, 1024), 8)  # float32 θ = W2ᵀ: n = 4096, p = 1024
    assert cost["gather"] == pytest.approx(7 / 8 * 3 * 4096 * 1024 * 4)
    assert cost["owner"] == pytest.approx(7 / 64 * 5 * 4096 * 1024 * 4)
    assert cost["rows"] == pytest.approx(2 * 7 / 8 * (2 * 1024**2 + 1.5 * 1024 * 1025 + 1) * 4)
    # float64: every path's bytes double (the blocks are summed in float64), so a move worth
    # 1.7 MiB in float32 is worth 3.4 MiB — past the ×3 margin — and the choice is made per dtype
    wide64 = torch.empty(4096, 1024, device="meta", dtype=torch.float64)
    assert path_bytes(wide64, wide64, 8) == {k: 2 * v for k, v in cost.items()}
    square64 = torch.empty(384, 384, device="meta", dtype=torch.float64)
    assert moved([(384, 384)], 4) == () and moved_to_owners([(square64, square64)], [], 4) == (0,)


def test_owner_layout_accepts_only_pieces_that_tile_the_tensor():
    """The owner path steps a layer only where the ranks' pieces (as torch places them) cover
    it exactly once; gaps, overlaps and pieces out of bounds send it to the gather instead."""
    from fgd_fast.owners import _deal, _tiles

    rows = [((3, 4), (0, 0)), ((3, 4), (3, 0)), ((0, 4), (6, 0))]  # uneven, an empty piece
    assert _tiles((6, 4), rows)
    assert _tiles((6, 4), [((6, 2), (0, 0)), ((6, 2), (0, 2))])  # columns
    assert _tiles((4, 4), [((2, 2), (r, c)) for r in (0, 2) for c in (0, 2)])  # a 2-D mesh's blocks
    assert not _tiles((6, 4), rows[:2] + [((1, 4), (5, 0))])  # row 5 twice
    assert not _tiles((6, 4), [((3, 4), (0, 0)), ((2, 4), (4, 0))])  # a gap
    assert not _tiles((6, 4), [((3, 4), (0, 0)), ((4, 4), (3, 0))])  # out of bounds
    # the right volume, yet row 2 twice and row 5 never; rows 6 and 7 past the end and row 3 never
    assert not _tiles((6, 4), [((3, 4), (0, 0)), ((3, 4), (2, 0))])
    assert not _tiles((6, 4), [((3, 4), (0, 0)), ((3, 4), (4, 0))])
    # owners: the largest layer first, each to the least loaded rank, ties to the lower rank
    assert _deal([5, 1, 4, 4], 2) == (0, 0, 1, 1) and _deal([1, 1, 1], 4) == (0, 1, 2)
