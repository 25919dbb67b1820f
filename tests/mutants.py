"""Planted mutants of the code that protects users (the step guard, the checks, the failed-step
contract), for ``tests/test_mutants.py``: each must make at least one named test fail.

``python tests/mutants.py [--json FILE] [NAME ...]`` plants each mutant in turn (:func:`plant`
returns the undo), runs the tests named for it in the same process (``pytest.main``, one
interpreter start for all) and reports each exit status; it exits 0 when every mutant was
killed (status 1: a test failed). Each entry names the tests expected to kill it, so the run
stays short. A mutant is planted by rebinding a function, by an edit of a Triton kernel's source
(``KERNEL_EDITS``) or by an edit of a Python function's source (``SOURCE_EDITS``)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import torch

from fgd_fast import guards
from fgd_fast.backends import guard_rule
from fgd_fast.backends.layout import Layout

RULE = "tests/test_guard_rule.py"
GUARD = "tests/test_guard.py"
DIST = "tests/test_distributed.py"
CARRY = "tests/test_gram_carry.py"
BAD = "tests/test_bad_input.py"
LANDING = "tests/test_landing.py"
BASE = "tests/test_baselines.py"
LOAD = "tests/test_citizen.py::test_a_state_dict_with_unusable_guard_state_or_options_is_refused"
SAVED = "tests/test_checkpoint_load.py"
BASE_STATE = "tests/test_baselines_state.py"
BASE_CHECKS = "tests/test_baselines_checks.py"
LAZY = "tests/test_lazy_velocity.py"
EDGES = "tests/test_api_edges.py"
FAILED = "tests/test_failed_step_contract.py"
BLEND = "tests/test_guard_blend.py"
ORDER = "tests/test_program_order.py"
SHARED = "tests/test_shared_memory.py"
CONTRACT = "tests/test_backend_contract.py"
#: mutants of the collectives, planted in the ranks' processes (tests/distributed_cases.py reads
#: this variable, set while the mutant is planted, and calls :func:`plant_here`)
IN_RANKS = "FGD_TEST_MUTANT"

#: the mutants planted in the ranks' processes (:func:`plant_here`)
RANK_MUTANTS = (
    "owner_checks_unshared",
    "grad_sq_unsummed",
    "phi_sq_of_own_rows",
    "guard_settings_not_agreed",
    "local_checks_unshared",
    "sharded_checks_kept_in_groups",
    "owner_failure_unshared",
    "strided_layout_unchecked",
    "gathered_plan_unchecked",
    "distance_summed_over_replicas",
    "gather_packs_2d_meshes",
    "step_refusal_unshared",
    "saved_state_unshared",
)

#: mutant → (what it breaks, the tests that must catch it)
MUTANTS = {
    "raise_when_guard_binds": (
        "raise whenever the guard scaled or reset a step",
        [f"{GUARD}::test_gradient_spike_is_survived_by_default[torch]"],
    ),
    "never_reset": (
        "write the full step where the rule would reset",
        [f"{RULE}::test_high_feedback_with_spikes_never_raises[0.99]"],
    ),
    "target_off": (
        "no limit on the distance after the step (the old trust region's absence)",
        [f"{RULE}::test_high_feedback_with_spikes_never_raises[0.99]"],
    ),
    "failed_step_adds_state_key": (
        "a step that then fails leaves a new state key behind",
        ["tests/test_failed_step_contract.py::test_non_finite_gradient_raises_and_changes_nothing[nan-FGD-torch]"],
    ),
    "drop_velocity_gram": (
        "the prediction without s²UᵀU (the old bound's missing term)",
        [f"{RULE}::test_prediction_is_the_exact_distance_after_the_step"],
    ),
    "no_rounding_margin": (
        "the prediction made before rounding to the stored dtype",
        [f"{RULE}::test_16_bit_parameters_are_stored_within_the_limit[dtype0-auto]"],
    ),
    "finite_from_norm": (
        "‖g‖² overflow read as a non-finite gradient",
        [f"{RULE}::test_a_huge_finite_float64_gradient_is_not_called_non_finite[torch]"],
    ),
    "full_step_unchecked": (
        "the full-step-first path (CPU) writes the full step without checking its distance",
        [f"{RULE}::test_backends_decide_alike_when_the_guard_binds[torch]"],
    ),
    "owner_checks_unshared": (
        "the owner path's checks not summed over the ranks (each rank sees only its own layers')",
        [f"{DIST}::test_fsdp_refusal_is_collective[2]"],
    ),
    "local_checks_unshared": (
        "the unsharded layers' check verdict not agreed beside sharded ones (the passing ranks write, then wait)",
        [f"{DIST}::test_a_check_failing_on_one_ranks_unsharded_layer_stops_every_rank[2]"],
    ),
    "sharded_checks_kept_in_groups": (
        "a sharded layer's failed check not agreed beyond its group (a sub-mesh, HSDP's shards): the other ranks write",
        [f"{DIST}::test_a_sharded_check_failed_on_part_of_the_ranks_stops_every_rank[hsdp-off]"],
    ),
    "owner_failure_unshared": (
        "an owner rank's failure (out of memory) not carried by the checks' all-reduce: the others wait",
        [f"{DIST}::test_a_failure_on_the_owner_rank_stops_every_rank"],
    ),
    "strided_layout_unchecked": (
        "the owner path's table of a strided shard's pieces not checked against the pieces: a misplaced box is stepped",
        [f"{DIST}::test_a_layout_table_that_misplaces_a_strided_shard_sends_the_layer_to_the_gather"],
    ),
    "gathered_plan_unchecked": (
        "a gathered layer's guard verdicts and distance after the step dropped by the write-back: no guard statistics, "
        "and a step beyond max_distance written",
        [
            f"{DIST}::test_sharding_gather_steps_row_shards_whole_and_exactly",
            f"{DIST}::test_a_step_that_would_leave_the_manifold_is_refused_on_every_path[gather]",
        ],
    ),
    "distance_summed_over_replicas": (
        "a row-sharded layer's float64 Gram (orthogonality(), stiefel_distance) summed over HSDP's replicas too",
        [f"{DIST}::test_hsdp_reduces_over_the_shard_dimension"],
    ),
    "gather_packs_2d_meshes": (
        "the packed all-gather taking a 2-D mesh's first placement for a 1-D shard (FSDP over TP gathered wrong)",
        [f"{DIST}::test_sharding_gather_on_fsdp_over_tensor_parallel_steps_exactly"],
    ),
    "step_refusal_unshared": (
        "FGD.step's own refusal on one rank (a buffer that does not fit there) not agreed: the others wait",
        [f"{DIST}::test_a_buffer_that_does_not_fit_on_one_rank_stops_every_rank[plain]"],
    ),
    "grad_sq_unsummed": (
        "the row shards' ‖g‖² (the guard's safety radius) left out of the all-reduce",
        [f"{DIST}::test_the_guard_binding_on_one_row_sharded_layer_matches_one_process[2]"],
    ),
    "phi_sq_of_own_rows": (
        "‖Φ‖² of row shards (asked where the summed tr C is not finite) from this rank's rows alone: a NaN in "
        "another rank's rows called finite there, the ranks deciding apart",
        [f"{DIST}::test_a_non_finite_momentum_in_one_ranks_rows_stops_every_rank"],
    ),
    "carry_ignores_versions": (
        "carried Gram blocks used after a write to θ or Φ between steps",
        [f"{CARRY}::test_writes_between_steps_are_seen"],
    ),
    "carry_ignores_addresses": (
        "carried Gram blocks used after p.data = other (vector_to_parameters) between steps",
        [f"{CARRY}::test_new_memory_assigned_through_data_is_seen"],
    ),
    "carry_kept_after_failed_step": (
        "a failed step's carried blocks (scaled in place by its middle) kept for the next step",
        [f"{CARRY}::test_a_failed_step_leaves_no_stale_blocks"],
    ),
    "blend_kernels_target_off": (
        "the Triton backend's blend kernels without the guard's target (every step kept)",
        [
            "tests/test_guard_blend.py::test_the_blend_kernels_choose_and_write_the_step_of_the_torch_ops[three-p-phi-dtype0]"
        ],
    ),
    "fused_trust_scale_off": (
        "the Triton fused middle without the trust scale (ρ = ∞: s = 1 whatever ‖Φ‖ + η‖g‖)",
        ["tests/test_fused_middle.py::test_the_fused_middle_writes_the_step_and_checks_of_the_torch_ops[three-p-phi]"],
    ),
    "fused_checks_finite_dropped": (
        "the Triton fused middle's check table reporting every layer's inputs finite",
        ["tests/test_fused_middle.py::test_a_non_finite_layer_is_reset_as_by_the_torch_ops"],
    ),
    "velocity_bound_dropped": (
        "the torch backend's bounded prediction without its s²UᵀU bound (‖Y‖ alone decides)",
        ["tests/test_lazy_velocity.py::test_a_step_off_the_tangent_space_is_scaled_as_the_exact_rule_says[phi]"],
    ),
    "step_bound_first_order_dropped": (
        "the torch backend's product-free bound of the full step without its first-order term 2‖M + T‖",
        ["tests/test_lazy_velocity.py::test_step_bound_is_an_upper_bound_and_attained"],
    ),
    "reset_terms_not_zeroed": (
        "the torch backend writing a reset layer's gradient term as 0·g (NaN for a NaN g) instead of 0",
        [
            "tests/test_backend_agreement.py::test_a_nan_gradient_with_the_checks_off_is_reset_and_writes_nothing_non_finite"
        ],
    ),
    "reset_masks_from_last_chunk": (
        "the torch backend's reset masks skipped when only the last middle chunk of a bucket had no reset "
        "(a NaN g written into θ on a GPU's chunked middle)",
        ["tests/test_torch_backend.py::test_a_reset_in_one_middle_chunk_writes_nothing_non_finite"],
    ),
    "reset_hyper_zero_times_nan": (
        "the fused backends' update table as [s·η, s·β, α] by plain products: 0·NaN for a reset under a NaN lr",
        [
            "tests/test_device_lr.py::test_a_non_finite_lr_on_the_device_resets_and_writes_nothing_non_finite"
            f"[triton-{case}-nan-device-only]"
            for case in ("f64", "f32-paper")
        ],
    ),
    "layout_indices_inference": (
        "the layout's cached indices built inside the CPU step's torch.inference_mode (they outlive it)",
        ["tests/test_torch_backend.py::test_cpu_step_in_inference_mode_leaves_normal_tensors_and_autograd_safe"],
    ),
    "no_newton_reset": (
        "no Newton–Schulz reset when the α pull-back is beyond the target",
        [f"{RULE}::test_chosen_weight_is_the_largest_that_fits_and_its_distance_is_exact"],
    ),
    "guard_limits_unchecked": (
        "max_distance and trust_radius taken as given (0, negative, past the Neumann radius)",
        [
            f"{BAD}::test_construction_rejects_bad_hyper_parameters[kwargs9-max_distance]",
            f"{BAD}::test_functional_step_rejects_bad_guard_settings[kwargs1-trust_radius]",
        ],
    ),
    "orthogonal_buffer_unchecked": (
        "an orthogonal parameter's momentum_buffer in opt.state used without checking it fits",
        [f"{BAD}::test_unusable_momentum_buffer_in_state_raises_before_any_write[shape-orthogonal]"],
    ),
    "euclidean_buffer_unchecked": (
        "a Euclidean parameter's momentum_buffer in opt.state used without checking it fits",
        [f"{BAD}::test_unusable_momentum_buffer_in_state_raises_before_any_write[shape-euclidean]"],
    ),
    "loaded_options_unchecked": (
        "a state_dict's optimizer-wide options loaded without the groups' agreement or validation",
        [
            f"{LOAD}[max_distance-max_distance]",
            f"{LOAD}[groups_disagree-optimizer-wide option max_distance]",
        ],
    ),
    "saved_guard_count_unchecked": (
        "a state_dict's guard_count loaded whatever its shape and dtype",
        [f"{LOAD}[guard_count_fraction-guard_count]"],
    ),
    "duplicate_orthogonal_unchecked": (
        "a parameter listed twice in an orthogonal group accepted (stepped twice, off the manifold)",
        [
            f"{BAD}::test_a_parameter_listed_twice_in_an_orthogonal_group_is_refused",
            f"{BAD}::test_a_parameter_appended_twice_after_construction_is_refused_at_the_step",
        ],
    ),
    "shared_memory_param_accepted": (
        "a parameter whose entries share memory (expand()) accepted: the step fails after other writes",
        [f"{BAD}::test_a_parameter_whose_entries_share_memory_is_refused_when_added"],
    ),
    "update_kernel_snapshot_without_barrier": (
        "the CUDA-core update kernel reading its θ snapshot with no barrier after storing it (a race between "
        "the threads of a program, on a GPU only)",
        [f"{ORDER}::test_no_program_touches_what_another_program_of_its_launch_stores[cuda-cores-float32-phi]"],
    ),
    "shared_memory_unchecked": (
        "parameters or state sharing memory accepted (two Parameters of one tensor, a buffer of two layers)",
        [
            f"{SHARED}::test_parameters_sharing_memory_are_refused_when_added_and_at_the_step",
            f"{SHARED}::test_state_sharing_memory_is_refused_before_any_write",
            f"{SHARED}::test_the_functional_step_refuses_parameters_and_buffers_that_share_memory",
        ],
    ),
    "state_entries_overlap_unchecked": (
        "a state buffer whose entries share memory (expand()) accepted: an in-place write fails mid-step",
        [f"{SHARED}::test_state_sharing_memory_is_refused_before_any_write"],
    ),
    "listed_again_unchecked": (
        "an orthogonal parameter also in a plain group's list stepped twice (FGD, then SGD on its Φ)",
        [f"{SHARED}::test_an_orthogonal_parameter_also_in_a_plain_groups_list_is_refused"],
    ),
    "plain_step_after_orthogonal_writes": (
        "the plain groups' SGD after the orthogonal writes (running out of memory there: a half-taken step)",
        [
            f"{FAILED}::test_out_of_memory_in_the_plain_groups_step_leaves_the_orthogonal_layers_as_they_were"
            "[FGD-torch-steady]"
        ],
    ),
    "autocast_left_on": (
        "a step inside torch.autocast computing in 16 bits (the torch backend's in-place products failing)",
        ["tests/test_citizen.py::test_a_step_inside_autocast_is_the_step_outside_it"],
    ),
    "guard_room_unchecked": (
        "a 16-bit parameter whose rounding margin takes all of max_distance stepped (every step reset)",
        [f"{RULE}::test_a_16_bit_parameter_the_guard_cannot_step_is_refused"],
    ),
    "fgd_tensor_lr_unchecked": (
        "fgd_fast.fgd takes a tensor lr unchecked (a NaN one wrote NaN)",
        ["tests/test_device_lr.py::test_fgd_checks_a_tensor_lr_as_fgd_the_optimizer_does"],
    ),
    "landing_buffer_unchecked": (
        "LandingSGD's finiteness check without the momentum buffer",
        [f"{LANDING}::test_a_non_finite_gradient_or_buffer_raises_and_changes_nothing[momentum_buffer]"],
    ),
    "landing_pull_uncapped": (
        "LandingSGD's safe step without the cap 1/(2λ) (the pull overshoots past ε)",
        [f"{LANDING}::test_the_safe_step_caps_the_pull_at_half_over_lambda"],
    ),
    "cayley_overflow_unchecked": (
        "Cayley SGD/ADAM steps without the finiteness of their coefficients and v (a huge finite G wrote NaN)",
        [f"{BASE}::test_a_finite_gradient_that_overflows_in_the_step_raises_and_changes_nothing"],
    ),
    "cayley_saved_moments_unchecked": (
        "Cayley ADAM's saved exp_avg_sq and step loaded unchecked",
        [f"{BASE}::test_cayley_adam_refuses_unusable_saved_moments"],
    ),
    "cayley_one_bucket_per_shape": (
        "Cayley SGD/ADAM stack equal-shape layers whatever their state (step count, buffer)",
        [f"{BASE}::test_equal_shapes_at_different_step_counts_step_as_separate_groups"],
    ),
    "guard_settings_not_agreed": (
        "the ranks' guard settings (max_distance, guard, trust_radius, variant, check_manifold) not compared",
        [f"{DIST}::test_ranks_that_disagree_raise_alike_instead_of_diverging_or_hanging"],
    ),
    "velocity_overflow_kept": (
        "the torch backend keeps a scaled velocity Gram that overflowed float32 (a huge finite g reset)",
        [
            f"{GUARD}::test_a_huge_finite_gradient_is_scaled_as_the_reference_scales_it[1e+20-0.9-1]",
            f"{GUARD}::test_a_huge_finite_gradient_is_scaled_as_the_reference_scales_it[1e+20-0.0-2]",
        ],
    ),
    "saved_state_unshared": (
        "load_state_dict's verdict on sharded state not agreed across the ranks (one refuses, the others load)",
        [f"{DIST}::test_a_dcp_load_refused_on_one_rank_is_refused_on_every_rank"],
    ),
    "saved_finite_before_cast": (
        "a saved buffer checked finite in its own dtype, not the one it is cast to (Inf in a float16 weight)",
        [f"{SAVED}::test_a_buffer_that_overflows_the_parameters_dtype_is_refused[FGD]"],
    ),
    "saved_structure_unchecked": (
        "a state_dict's outline (state entries as dicts, groups with params) taken as given",
        [f"{SAVED}::test_a_malformed_state_dict_is_refused_with_the_reason[entry_not_a_dict]"],
    ),
    "landing_step_overflow_unchecked": (
        "LandingSGD's finiteness check without the new θ and buffer (a finite g that overflows writes NaN)",
        [f"{BASE_STATE}::test_a_finite_gradient_whose_landing_step_overflows_raises_and_changes_nothing[None]"],
    ),
    "baseline_state_unchecked": (
        "the baselines' orthogonal state used without checking it fits (Landing wrote θ, then failed)",
        [f"{BASE_STATE}::test_state_that_does_not_fit_an_orthogonal_parameter_is_refused_before_any_write[LandingSGD]"],
    ),
    "state_kind_unchecked": (
        "a group's orthogonal flag flipped between steps: the other kind's state read as this one's",
        [f"{BASE_STATE}::test_a_group_flag_flipped_between_steps_does_not_reuse_the_state[False-FGD]"],
    ),
    "state_kind_record_lost": (
        "the flags a state was made under forgotten by a copy or a load: a flipped flag reads the other kind's state",
        [f"{EDGES}::test_state_made_under_the_other_flag_is_refused_after_a_copy_or_a_load[load]"],
    ),
    "step_writability_unchecked": (
        "a parameter the step cannot write (inference tensor, shared entries) found only after other writes",
        [f"{EDGES}::test_a_parameter_the_step_cannot_write_is_refused_before_any_write[torch]"],
    ),
    "functional_writability_unchecked": (
        "the functional step finds a parameter it cannot write only after writing the ones before it",
        [f"{FAILED}::test_the_functional_step_refuses_an_unwritable_parameter_before_writing_any[inference-torch]"],
    ),
    "other_calls_checks_unread": (
        "only the first backend call's checks read (a second call on the device, e.g. a sharded layer's, unread)",
        [f"{GUARD}::test_every_table_of_calls_sharing_a_device_is_read[finite]"],
    ),
    "landing_hyper_unchecked": (
        "LandingSGD's groups checked for their keys only (a negative lr, a momentum of 1 went in)",
        [f"{BASE_CHECKS}::test_landing_refuses_bad_hyper_parameters[lr]"],
    ),
    "adapter_options_checked_late": (
        "the adapters leave their options to torch's SGD, which refuses them after the model was changed",
        [f"{BASE_CHECKS}::test_the_adapters_refuse_bad_options_before_touching_the_model[torch-lr]"],
    ),
    "cayley_saved_v_any_dtype": (
        "Cayley ADAM's saved exp_avg_sq taken in any dtype (an integer v truncated every later average)",
        [f"{BASE_CHECKS}::test_cayley_adam_refuses_a_boolean_step_or_an_integer_second_moment[integer-v]"],
    ),
    "step_bound_without_m_squared": (
        "the step distance's norm bound without its (1 + ‖D‖)‖M‖² term (below the distance: exact check skipped)",
        [f"{LAZY}::test_step_bound_is_attained_with_every_second_order_term[0.0-0.5-0.0]"],
    ),
    "guard_margin_of_first_p": (
        "one middle over several p taking the first group's p for every layer's rounding margin",
        [
            "tests/test_layout.py::test_one_middle_over_several_p_is_the_per_group_middles[coarse-spike-official-host-read]"
        ],
    ),
    "row_shard_velocity_unsummed": (
        "row shards re-forming (sU)ᵀ(sU) after an overflow without summing it over the ranks",
        ["tests/test_row_shards.py::test_a_gradient_past_the_float32_gram_range_is_scaled_as_on_whole_matrices[phi-2]"],
    ),
    "fused_rule_cached_without_radius": (
        "the fused middle's per-layer rule table (ρ, target) reused for another trust radius",
        ["tests/test_fused_middle.py::test_the_rule_follows_each_calls_radius_limit_and_unit"],
    ),
    "step_guard_count_unchecked": (
        "the guard's counters that do not fit found only when the step adds to them, after θ and Φ were written",
        [f"{FAILED}::test_guard_counters_that_do_not_fit_are_refused_before_any_write[shape-torch]"],
    ),
    "guard_kernel_movable_ignored": (
        "the guard's rule kernel keeping a step the middle marked not movable (its distances within the target)",
        [f"{BLEND}::test_the_rule_resets_a_layer_not_movable_or_with_a_non_finite_m_phi_whatever_its_distances"],
    ),
    "guard_kernel_m_phi_unchecked": (
        "the guard's sums kernel not checking M_Φ finite (an Inf in M_Φ kept where the distances are finite)",
        [f"{BLEND}::test_the_rule_resets_a_layer_not_movable_or_with_a_non_finite_m_phi_whatever_its_distances"],
    ),
    "update_kernel_reads_beta_phi_at_zero": (
        "the tensor-core update kernel reading βΦ at a reset's β = 0 (0·NaN: a NaN momentum buffer written into θ)",
        [
            "tests/test_backend_agreement.py::"
            "test_a_nan_momentum_buffer_with_the_checks_off_is_reset_and_writes_nothing_non_finite[triton-f32]"
        ],
    ),
    "guard_kernel_fits_without_sqrt_p": (
        "the guard's rule kernel bounding a 16-bit θ₊ by d + p, not √p·d + p (an overflowing float16 step fits)",
        [f"{BLEND}::test_a_float16_step_fits_by_the_bound_of_the_frobenius_norm[16]"],
    ),
    "update_kernel_shares_one_snapshot_slab": (
        "the CUDA-core update kernel's programs sharing one θ snapshot slab (a race on a GPU only: the "
        "interpreter runs each program whole)",
        [f"{ORDER}::test_no_program_touches_what_another_program_of_its_launch_stores[cuda-cores-float32-phi]"],
    ),
    "overlap_span_one_entry_short": (
        "two parameters sharing exactly one entry accepted (each tensor's byte span one entry short)",
        [f"{SHARED}::test_views_that_share_one_entry_or_bytes_of_another_dtype_are_refused"],
    ),
    "auto_takes_triton_without_tf32_tensor_cores": (
        '"auto" picking the Triton tensor-core step on a GPU older than Ampere (its TF32 products as fp32 FMA)',
        [f"{CONTRACT}::test_auto_picks_the_tensor_core_step_only_where_tf32_tensor_cores_are[sm_75]"],
    ),
    "reset_parameter_keeps_the_momentum": (
        "reset_parameter leaving Φ in place (the next step is not a first step)",
        [
            "tests/test_bad_input.py::test_reset_parameter_projects_and_clears_the_momentum_so_the_next_step_is_a_first_step"
        ],
    ),
    "reset_parameter_without_projection": (
        "reset_parameter clearing Φ but leaving θ off the manifold",
        [
            "tests/test_bad_input.py::test_reset_parameter_projects_and_clears_the_momentum_so_the_next_step_is_a_first_step"
        ],
    ),
    "new_group_check_ignores_the_state": (
        "add_param_group accepting a parameter over an orthogonal layer's momentum buffer (only the step refused it)",
        [f"{SHARED}::test_a_new_parameter_over_an_orthogonal_parameters_state_is_refused_when_added"],
    ),
    "overlap_of_other_dtypes_accepted": (
        "views of one storage with entries of other sizes accepted where their bytes overlap",
        [f"{SHARED}::test_views_that_share_one_entry_or_bytes_of_another_dtype_are_refused"],
    ),
    "carried_trace_unclamped": (
        "a carried C₊'s trace rounding below 0 (Φ₊ ≈ 0) taken as is: its root NaN, the guard resets",
        [f"{CARRY}::test_a_gradient_in_the_normal_space_never_resets_a_carried_step"],
    ),
    "state_kind_record_kept_after_clear": (
        "the record of a state's kind kept from before a clearing: a flip back over state of the other kind stepped",
        ["tests/test_baselines_state.py::test_a_group_flag_flipped_between_steps_does_not_reuse_the_state"],
    ),
    "landing_pull_ignores_lr": (
        "Landing's pull beyond the safe distance at its cap 1/(2λ) whatever the lr (at lr = 0 it moved θ)",
        [f"{LANDING}::test_beyond_the_safe_distance_the_pull_takes_the_smaller_of_lr_and_its_cap"],
    ),
    "trust_scale_without_floor": (
        "a trust scale too small for float32 (0 or subnormal) scaled by rather than reset: θ stored 8.5 off",
        [f"{GUARD}::test_a_trust_scale_float32_cannot_carry_resets_the_layer[zero-scale-torch]"],
    ),
    "middle_kernel_scale_without_floor": (
        "the Triton middle kernel scaling by a subnormal trust scale rather than resetting: θ stored 0.85 off",
        [f"{GUARD}::test_a_trust_scale_float32_cannot_carry_resets_the_layer[subnormal-scale-triton]"],
    ),
    "write_rounding_ignored": (
        "the unguarded check without the write's rounding: a cancelling step stored θ 110 off",
        [
            f"{GUARD}::test_without_the_guard_a_step_whose_rounding_could_leave_the_manifold_is_refused[1x1-float32-torch]"
        ],
    ),
    "fused_write_rounding_ignored": (
        "the Triton fused middle's unguarded check without the write's rounding: θ stored 1.0 off",
        [
            f"{GUARD}::test_without_the_guard_a_step_whose_rounding_could_leave_the_manifold_is_refused[1x1-float32-triton]"
        ],
    ),
    "fused_rounding_without_m_theta": (
        "the Triton fused middle's rounding bound without ‖M_θ‖ (it had read the slot the blend writes F to)",
        [f"{GUARD}::test_a_step_the_torch_backend_refuses_for_its_rounding_triton_refuses_too[1000000.0]"],
    ),
    "trust_scale_floor_of_float32_everywhere": (
        "float64 blocks reset below float32's smallest normal scale, which they carry",
        [f"{GUARD}::test_a_float64_layer_is_scaled_where_float32_blocks_could_not_carry_its_scale"],
    ),
    "cayley_moves_weights_at_lr_0": (
        "the Cayley baselines renormalising / QR-ing the weights at lr 0 (a checkpoint's state made there moved them)",
        ["tests/test_baselines.py::test_a_step_at_lr_0_leaves_the_weights_as_they_are[CayleySGD-qr-float]"],
    ),
    "guard_margin_without_tf32": (
        "the guard's margin at single-pass TF32 without TF32's rounding: θ stored 2.5e-4 past max_distance",
        [f"{GUARD}::test_the_guard_at_single_pass_tf32_keeps_room_for_its_measurement[5-triton]"],
    ),
    "gradients_not_checked_for_aliases": (
        "a gradient over a parameter or buffer the step writes accepted (read after that write: backends differ)",
        [
            f"{SHARED}::test_a_gradient_over_memory_the_step_writes_is_refused_before_any_write[FGD-torch-plain-parameter]"
        ],
    ),
    "triton_version_unchecked": (
        "a Triton older than the tested 3.6 loaded as if it were one (failing later in its own way)",
        ["tests/test_bad_input.py::test_a_triton_older_than_the_tested_one_is_refused_with_the_reason[3.5.0]"],
    ),
    "parameter_names_unchecked": (
        "two parameters of one name accepted: orthogonality() and guard_stats() keep one entry for both",
        ["tests/test_optimizer.py::test_groups_from_sub_modules_need_distinct_names[FGD]"],
    ),
    "hooked_norm_unwarned": (
        "a convolution under the hook-based spectral_norm / weight_norm left out of the rule without a word",
        ["tests/test_optimizer.py::test_the_norm_warning_names_what_the_rule_would_take_and_exclude_silences_it"],
    ),
    "frozen_weights_unwarned": (
        "frozen weights the rule takes left out of the groups without a word (never stepped once unfrozen)",
        ["tests/test_optimizer.py::test_frozen_parameters_are_in_no_group"],
    ),
    "matmul_precision_of_the_last_region": (
        "overlapping steps' precision regions: a TF32 region entered beside an IEEE one gives it TF32 products",
        [
            "tests/test_threads.py::test_overlapping_regions_get_at_least_their_precision_and_the_last_restores_the_users"
        ],
    ),
    "matmul_precision_restored_per_region": (
        "each region restoring the setting it found: two threads' steps leave TF32 on for the process",
        [
            "tests/test_threads.py::test_overlapping_regions_get_at_least_their_precision_and_the_last_restores_the_users"
        ],
    ),
    "caches_unlocked": (
        "the backends' caches iterated by one thread while another inserts (RuntimeError, KeyError)",
        ["tests/test_threads.py::test_the_caches_take_lookups_and_insertions_from_many_threads"],
    ),
    "table_built_under_the_lock": (
        "a cached table built while holding the caches' lock (ranks as threads: a collective inside hangs)",
        ["tests/test_threads.py::test_a_table_is_built_outside_the_caches_lock"],
    ),
    "layout_memo_unbounded": (
        "a layout's memo (and every table cache) growing by one entry per value a search tries",
        ["tests/test_threads.py::test_a_layouts_memo_keeps_its_newest_entries_and_those_a_capture_used"],
    ),
}


def _replace(name: str, new, undo: list) -> None:
    """Rebind ``name`` in every loaded fgd_fast module that imported the original."""
    old = getattr(guard_rule, name)
    for module in list(sys.modules.values()):
        if module is not None and module.__name__.startswith("fgd_fast") and getattr(module, name, None) is old:
            undo.append((module, name, old))
            setattr(module, name, new)


#: mutants of the Triton kernels' source: (module of fgd_fast.kernels, text, its replacement)
KERNEL_EDITS = {
    "middle_kernel_scale_without_floor": ("middle", "(r - r == 0.0) & (s64 >= meta.MIN_TRUST_SCALE)", "(r - r == 0.0)"),
    "guard_kernel_movable_ignored": ("guard", "(sums <= target * target) & movable", "(sums <= target * target)"),
    "guard_kernel_m_phi_unchecked": (
        "guard",
        " + tl.sum(tl.sum(_tile(m_phi_ptr + off, ri, cj, p, m) * 0.0, 1), 0)",
        "",
    ),
    "guard_kernel_fits_without_sqrt_p": (
        "guard",
        "(dist * tl.sqrt(p) + p < top64 * top64)",
        "(dist + p < top64 * top64)",
    ),
    "update_kernel_shares_one_snapshot_slab": (
        "fgd_step",
        "slab = scratch_ptr + pid.to(tl.int64) * BR * P_MAX",
        "slab = scratch_ptr",
    ),
    "update_kernel_snapshot_without_barrier": (
        "fgd_step",
        "cols[None, :], t, mask=m)\n            tl.debug_barrier()\n",
        "cols[None, :], t, mask=m)\n",
    ),
    "update_kernel_reads_beta_phi_at_zero": (
        "tc_step",
        "u += tl.where(beta == 0.0, 0.0, beta * tl.load(phi + off, mask=m, other=0.0))",
        "u += beta * tl.load(phi + off, mask=m, other=0.0)",
    ),
}


#: mutants of a Python function's source: (module, the function's qualified name, text, replacement)
SOURCE_EDITS = {
    "overlap_span_one_entry_short": ("fgd_fast.validation", "_span", "extent = 1 + sum(", "extent = sum("),
    "auto_takes_triton_without_tf32_tensor_cores": (
        "fgd_fast.backends",
        "_tf32_tensor_cores",
        "return torch.cuda.get_device_capability(device) >= (8, 0)",
        "return torch.cuda.get_device_capability(device) >= (7, 0)",
    ),
    "reset_parameter_keeps_the_momentum": (
        "fgd_fast.optimizer",
        "FGD.reset_parameter",
        'self.state.get(p, {}).pop("momentum_buffer", None)',
        "pass",
    ),
    "reset_parameter_without_projection": ("fgd_fast.optimizer", "FGD.reset_parameter", "orthogonalize_(p)", "pass"),
    "new_group_check_ignores_the_state": (
        "fgd_fast._stiefel_optimizer",
        "StiefelOptimizer._check_memory_of_new",
        "state = self.state.get(p, {}) if isinstance(p, torch.Tensor) else {}",
        "state = {}",
    ),
    "overlap_of_other_dtypes_accepted": (
        "fgd_fast.validation",
        "_overlap",
        "if a.element_size() != b.element_size():\n        return True",
        "if a.element_size() != b.element_size():\n        return False",
    ),
    "carried_trace_unclamped": (
        "fgd_fast.backends.algebra",
        "middle",
        "phi_sq = phi_sq.clamp_min_(0.0)",
        "pass",
    ),
    "state_kind_record_kept_after_clear": (
        "fgd_fast._stiefel_optimizer",
        "StiefelOptimizer._check_state_kind",
        'if made is None or made != group["orthogonal"]:',
        "if made is None:",
    ),
    "landing_pull_ignores_lr": ("fgd_fast.baselines.landing", "LandingSGD._landing", "min(lr, 0.5 / lam)", "0.5 / lam"),
    "trust_scale_without_floor": (
        "fgd_fast.backends.guard_rule",
        "trust_scale",
        "torch.where(s >= floor, s, 0.0)",
        "torch.where(finite_of(r), s, 0.0)",
    ),
    "write_rounding_ignored": (
        "fgd_fast.backends.guard_rule",
        "with_write_rounding",
        "return torch.where(bound > limit, bound, dist_next)",
        "return dist_next",
    ),
    "fused_write_rounding_ignored": (
        "fgd_fast.backends.fused_middle",
        "run",
        "if radius is None:  # the unguarded prediction",
        "if False:  # the unguarded prediction",
    ),
    "fused_rounding_without_m_theta": (
        "fgd_fast.backends.fused_middle",
        "run",
        "m_norm = lay.norm(shaped(m_phi)).to(torch.float64) + alpha * result[:, meta.GB_R_DIST0]",
        "m_norm = 0.0 * alpha",
    ),
    "trust_scale_floor_of_float32_everywhere": (
        "fgd_fast.backends.algebra",
        "middle",
        "trust_scale(phi_norm, g_norm, lr, radius, torch.finfo(a.dtype).tiny)",
        "trust_scale(phi_norm, g_norm, lr, radius)",
    ),
    "cayley_moves_weights_at_lr_0": (
        "fgd_fast.baselines._base",
        "CayleyBase._prepare",
        'resting = not lr_on_device(g["lr"]) and float(g["lr"]) == 0.0',
        "resting = False",
    ),
    "guard_margin_without_tf32": (
        "fgd_fast.backends.guard_rule",
        "store_unit",
        "tf32 = TF32_UNIT if tf32_grams and dtype != torch.float64 else 0.0",
        "tf32 = 0.0",
    ),
    "gradients_not_checked_for_aliases": (
        "fgd_fast._stiefel_optimizer",
        "_Memory.add",
        "if isinstance(p.grad, torch.Tensor) and not is_dtensor(p.grad):",
        "if False:",
    ),
    "triton_version_unchecked": (
        "fgd_fast.backends",
        "_load_triton",
        "if _release(version) < MIN_TRITON:",
        "if False:",
    ),
    "parameter_names_unchecked": (
        "fgd_fast._stiefel_optimizer",
        "StiefelOptimizer._check_names_of_new",
        "if name in seen:",
        "if False:",
    ),
    "hooked_norm_unwarned": (
        "fgd_fast.selection",
        "_normed_convs",
        'hooked = "weight" not in m._parameters and',
        "hooked = False and",
    ),
    "frozen_weights_unwarned": ("fgd_fast.selection", "stiefel_param_groups", "if frozen:  #", "if False:  #"),
    "matmul_precision_of_the_last_region": (
        "fgd_fast.backends.shared_state",
        "matmul_precision",
        'want == "ieee" or _REGIONS.open["ieee"] > 0)',
        'want == "ieee")',
    ),
    "matmul_precision_restored_per_region": (
        "fgd_fast.backends.shared_state",
        "matmul_precision",
        "if not any(_REGIONS.open.values()):",
        "if True:",
    ),
    "caches_unlocked": (
        "fgd_fast.backends.shared_state",
        "cache_lock",
        "if torch.compiler.is_compiling() else _CACHES",
        "if True else _CACHES",
    ),
    "table_built_under_the_lock": (
        "fgd_fast.backends.shared_state",
        "cached_entry",
        "if not found:\n        with torch.inference_mode(False):",
        "if not found:\n        with cache_lock(), torch.inference_mode(False):",
    ),
    "layout_memo_unbounded": (
        "fgd_fast.backends.shared_state",
        "cached_entry",
        "for k in unpinned[: max(0, len(unpinned) - capacity)]:",
        "for k in []:",
    ),
}


def _plant_source_edit(module: str, qualname: str, old: str, new: str, undo: list) -> None:
    """Recompile function ``qualname`` of ``module`` from its source with ``old`` replaced (once),
    in the module's globals, and bind it where the original was: on its class, or in every loaded
    fgd_fast module that imported it (as :func:`_replace` does)."""
    import importlib
    import inspect
    import textwrap

    mod = importlib.import_module(module)
    owner, _, attr = qualname.rpartition(".")
    holder = getattr(mod, owner) if owner else mod
    original = inspect.unwrap(vars(holder)[attr]) if owner else getattr(mod, attr)
    source = textwrap.dedent(inspect.getsource(original))
    if source.count(old) != 1:
        raise ValueError(f"the mutant's text is not once in {module}.{qualname}: {old!r}")
    scope: dict = {}
    exec(compile(source.replace(old, new), inspect.getsourcefile(original), "exec"), mod.__dict__, scope)
    mutated = scope[attr]
    if owner:
        undo.append((holder, attr, vars(holder)[attr]))
        setattr(holder, attr, mutated)
        return
    for loaded in list(sys.modules.values()):
        if loaded is not None and loaded.__name__.startswith("fgd_fast") and getattr(loaded, attr, None) is original:
            undo.append((loaded, attr, original))
            setattr(loaded, attr, mutated)


def _plant_kernel_edit(module: str, old: str, new: str, undo: list) -> None:
    """Rebuild ``fgd_fast.kernels.<module>`` from its source with ``old`` replaced (once) in a module
    of its own (written to a temporary file: Triton reads a kernel's source), and put its Triton
    functions in the original module's place, where the backends look them up at each launch."""
    import atexit
    import importlib
    import shutil
    import tempfile
    import types

    import triton

    original = importlib.import_module(f"fgd_fast.kernels.{module}")
    with open(original.__file__) as f:
        source = f.read()
    if source.count(old) != 1:
        raise ValueError(f"the mutant's text is not once in kernels/{module}.py: {old!r}")
    folder = tempfile.mkdtemp(prefix="fgd-mutant-")
    atexit.register(shutil.rmtree, folder, True)  # (kept while the process may still compile from it)
    path, mutated = os.path.join(folder, f"{module}.py"), source.replace(old, new)
    with open(path, "w") as f:
        f.write(mutated)
    planted = types.ModuleType(f"fgd_fast.kernels._mutant_{module}")
    planted.__package__, planted.__file__ = "fgd_fast.kernels", path
    exec(compile(mutated, path, "exec"), planted.__dict__)
    for attr, value in list(vars(original).items()):
        if isinstance(value, triton.runtime.KernelInterface):  # (JITFunction, or the interpreter's)
            undo.append((original, attr, value))
            setattr(original, attr, getattr(planted, attr))


#: modules of the package the name check does not import (a just-in-time build, a developer tool)
_NOT_IMPORTED = ("fgd_fast.backends.cuda", "fgd_fast.kernels.aot")


@functools.cache
def _import_the_package() -> None:
    """Every module of the package imported (once), so a mutant's own imports find nothing new."""
    import importlib
    import pkgutil

    import fgd_fast
    import fgd_fast.kernels  # (a source tree maps kernels/ in as this package: walked on its own)

    found = [*pkgutil.walk_packages(fgd_fast.__path__, "fgd_fast.")]
    found += pkgutil.walk_packages(fgd_fast.kernels.__path__, "fgd_fast.kernels.")
    for info in found:
        if info.name not in _NOT_IMPORTED and info.name not in sys.modules:
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001  (an optional piece that cannot load here: nothing to patch)
                pass


def _module_names() -> dict[str, tuple[object, set[str]]]:
    """The names each module of the package, and each of its classes, holds (a class's inherited
    ones too); every module imported first, so a mutant's own imports find nothing new."""
    _import_the_package()
    modules = [(k, m) for k, m in list(sys.modules.items()) if k.startswith("fgd_fast") and m is not None]
    out = {k: (m, set(vars(m))) for k, m in modules}
    for k, m in modules:
        out.update({f"{k}.{c}": (v, set(dir(v))) for c, v in vars(m).items() if isinstance(v, type)})
    return out


def _check_no_name_added(name: str, before: dict[str, tuple[object, set[str]]]) -> None:
    """A mutant that sets a name a module or class of the package did not hold patched nothing
    the code calls (the function moved elsewhere, say): it would survive for that reason alone."""
    for where, (owner, names) in before.items():
        held = set(vars(owner)) if isinstance(owner, type(sys)) else set(dir(owner))
        added = [n for n in held - names if not isinstance(getattr(owner, n), type(sys))]  # (a submodule: fine)
        if added:
            raise RuntimeError(
                f"mutant {name!r} set {', '.join(sorted(added))} on {where}, which did not hold it: "
                "patch where the code calls it (moved?)"
            )


def plant(name: str) -> Callable[[], None]:
    """Plant mutant ``name``; returns the function that removes it."""
    import fgd_fast
    import fgd_fast.backends.reference  # noqa: F401  (loaded, so their imported names get rebound)
    import fgd_fast.backends.torch_batched  # noqa: F401
    import fgd_fast.functional  # noqa: F401

    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}: one of {', '.join(MUTANTS)}")
    before = _module_names()
    if os.environ.get(IN_RANKS) is None and name in RANK_MUTANTS:  # (a dry run here, undone: what the ranks patch)
        saved = _attributes()
        try:
            _plant_here(name)
            _check_no_name_added(name, before)
        finally:
            _restore(saved)
    try:
        return _plant(name)
    finally:
        _check_no_name_added(name, before)


def _attributes() -> dict:
    """Every attribute of the package's loaded modules and of their classes, to undo a dry run."""
    owners = [m for k, m in list(sys.modules.items()) if k.startswith("fgd_fast") and m is not None]
    owners += [v for m in list(owners) for v in vars(m).values() if isinstance(v, type)]
    return {id(o): (o, dict(vars(o))) for o in owners}


def _restore(saved: dict) -> None:
    for owner, attrs in saved.values():
        for attr in set(vars(owner)) - set(attrs):
            if not isinstance(vars(owner)[attr], type(sys)):  # (a submodule the dry run imported stays)
                delattr(owner, attr)
        for attr, value in attrs.items():
            if vars(owner).get(attr) is not value:
                setattr(owner, attr, value)


def _plant(name: str) -> Callable[[], None]:
    import fgd_fast
    import fgd_fast.functional

    undo: list = []
    if name in KERNEL_EDITS:
        _plant_kernel_edit(*KERNEL_EDITS[name], undo)
    elif name in SOURCE_EDITS:
        _plant_source_edit(*SOURCE_EDITS[name], undo)
    elif name in RANK_MUTANTS:
        os.environ[IN_RANKS] = name
        undo.append((os.environ, IN_RANKS, None))
    elif name == "raise_when_guard_binds":
        original = guards.raise_if_invalid

        def raising(*args, **kwargs):
            read = original(*args, **kwargs)
            if read and any(read):
                raise ValueError("mutant: the guard bound")
            return read

        undo.append((fgd_fast.functional, "raise_if_invalid", original))
        fgd_fast.functional.raise_if_invalid = raising
    elif name == "other_calls_checks_unread":
        original = guards.raise_if_invalid

        def first_call_only(dist, finite, index, labels, **kwargs):
            for key in ("dist_next", "finite_next", "guarded", "tables"):
                if kwargs.get(key) is not None:
                    kwargs[key] = list(kwargs[key])[:1]
            return original(list(dist)[:1], list(finite)[:1], list(index)[:1], labels, **kwargs)

        for module in (guards, fgd_fast.functional):
            undo.append((module, "raise_if_invalid", original))
            module.raise_if_invalid = first_call_only
    elif name in ("never_reset", "no_newton_reset"):
        original = guard_rule.choose_weight

        def chooser(d0, x1, x2, d_newton, *, target, movable, layout=None):
            blend = original(d0, x1, x2, d_newton, target=target, movable=movable, layout=layout)
            if name == "no_newton_reset":
                return blend._replace(newton=torch.zeros_like(blend.newton))
            full = (layout or Layout.of(d0)).norm(d0 + x1 + x2).to(torch.float64)
            return blend._replace(weight=torch.where(blend.weight == 0, 1.0, blend.weight), dist=full)

        _replace("choose_weight", chooser, undo)
    elif name == "target_off":
        _replace("guard_target", lambda limit, p, unit: float("inf"), undo)
    elif name == "failed_step_adds_state_key":
        original = fgd_fast.FGD.step

        def step(self, closure=None):
            try:
                return original(self, closure)
            except (ValueError, FloatingPointError):
                for group in self.param_groups:
                    for p in group["params"] if group.get("orthogonal") else []:
                        self.state[p]["mutant"] = torch.zeros(())
                raise

        undo.append((fgd_fast.FGD, "step", original))
        fgd_fast.FGD.step = step
    elif name == "velocity_overflow_kept":
        from fgd_fast.backends import algebra

        undo.append((algebra, "_unless_overflowed", algebra._unless_overflowed))
        algebra._unless_overflowed = lambda uu, gg, *rest: (uu, gg)
    elif name == "drop_velocity_gram":
        _replace("velocity_gram", lambda c, h, gg, beta, lr, layout=None: torch.zeros_like(gg), undo)
    elif name == "velocity_bound_dropped":
        _replace("velocity_bound", lambda phi_norm, g_norm, beta, lr, scale=None: torch.zeros_like(g_norm), undo)
    elif name == "step_bound_first_order_dropped":
        norm = lambda m, lay: (lay or Layout.of(m)).norm(m).to(torch.float64)  # noqa: E731
        _replace(
            "step_bound",
            lambda dist, m, t, layout=None: dist.double() * (1 + 2 * norm(m, layout)) + norm(m, layout) ** 2,
            undo,
        )
    elif name == "reset_terms_not_zeroed":
        from fgd_fast.backends import torch_bucket

        undo.append((torch_bucket, "zero_where", torch_bucket.zero_where))
        torch_bucket.zero_where = lambda x, mask: x
    elif name == "reset_masks_from_last_chunk":
        from fgd_fast.backends import torch_bucket

        take = torch_bucket.Bucket.take

        def last_chunk_only(self, gemm_chunks, mid, coef, no_reset):
            take(self, gemm_chunks, mid, coef, no_reset)
            self.no_reset = no_reset

        undo.append((torch_bucket.Bucket, "take", take))
        torch_bucket.Bucket.take = last_chunk_only
    elif name == "reset_hyper_zero_times_nan":
        from fgd_fast.backends import triton

        def product(hyper, scale):
            if scale is None:
                return hyper
            factor = torch.ones_like(hyper)
            factor[:, :2] = scale.to(hyper.dtype).unsqueeze(1)
            return hyper * factor

        cuda = sys.modules.get("fgd_fast.backends.cuda")  # (loaded only where the extension is)
        for module in (m for m in (triton, cuda) if m is not None):
            undo.append((module, "scaled_hyper", module.scaled_hyper))
            module.scaled_hyper = product
    elif name == "layout_indices_inference":
        from fgd_fast.backends import layout

        original = layout._Index.__init__

        def init(self, *args, **kwargs):
            with torch.inference_mode():
                original(self, *args, **kwargs)

        undo.append((layout, "_indices", {}))  # (the mutant's inference tensors not kept after it)
        undo.append((layout._Index, "__init__", original))
        layout._indices.clear()
        layout._Index.__init__ = init
    elif name == "full_step_unchecked":
        _replace("full_steps_fit", lambda dist_full, movable, target: True, undo)
    elif name == "no_rounding_margin":
        _replace("store_unit", lambda dtype: 0.0, undo)
    elif name == "finite_from_norm":  # the old rule: an infinite ‖g‖ is a non-finite gradient
        finite = guard_rule.finite_of
        _replace("inputs_finite", lambda g_norm, phi_sq, e, layout=None: finite(g_norm) & finite(phi_sq), undo)

    elif name == "blend_kernels_target_off":
        from fgd_fast.backends import guard_blend

        original = guard_blend.blend

        def blend(lay, **kwargs):
            return original(lay, **dict(kwargs, target=float("inf")))

        undo.append((guard_blend, "blend", original))
        guard_blend.blend = blend
    elif name == "fused_trust_scale_off":
        from fgd_fast.backends import fused_middle

        original = fused_middle._rule
        undo.append((fused_middle, "_rule", original))
        fused_middle._rule = lambda lay, radius, limit, unit: original(lay, float("inf"), limit, unit)
    elif name == "fused_checks_finite_dropped":
        from fgd_fast.backends import fused_middle
        from fgd_fast.kernels import meta

        original = fused_middle.FusedMiddle.__init__

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.check_table = self.check_table.clone()
            self.check_table[:, meta.GB_R_FINITE] = 1.0

        undo.append((fused_middle.FusedMiddle, "__init__", original))
        fused_middle.FusedMiddle.__init__ = init
    elif name == "guard_limits_unchecked":
        from fgd_fast import optimizer

        for module in (optimizer, fgd_fast.functional):
            for attr in ("check_max_distance", "check_trust_radius"):
                undo.append((module, attr, getattr(module, attr)))
                setattr(module, attr, lambda value: value)
    elif name == "duplicate_orthogonal_unchecked":
        from fgd_fast import _stiefel_optimizer

        original = fgd_fast.validation.check_orthogonal_params

        def once_each(params, names=None):  # the other checks as they are, on the list without repeats
            params = list(params)
            keep = [i for i, p in enumerate(params) if all(q is not p for q in params[:i])]
            return original([params[i] for i in keep], [names[i] for i in keep] if names else None)

        for module in (_stiefel_optimizer, fgd_fast.functional):
            undo.append((module, "check_orthogonal_params", module.check_orthogonal_params))
            module.check_orthogonal_params = once_each
    elif name == "shared_memory_param_accepted":
        from fgd_fast import _stiefel_optimizer

        undo.append((_stiefel_optimizer, "check_writable", _stiefel_optimizer.check_writable))
        _stiefel_optimizer.check_writable = lambda params: None
    elif name == "shared_memory_unchecked":
        from fgd_fast import _stiefel_optimizer

        for module in (_stiefel_optimizer, fgd_fast.functional):
            undo.append((module, "check_no_shared_memory", module.check_no_shared_memory))
            module.check_no_shared_memory = lambda *args, **kwargs: None
    elif name == "state_entries_overlap_unchecked":
        undo.append((fgd_fast.validation, "entries_share_memory", fgd_fast.validation.entries_share_memory))
        fgd_fast.validation.entries_share_memory = lambda t: False
    elif name == "listed_again_unchecked":
        from fgd_fast import _stiefel_optimizer

        undo.append((_stiefel_optimizer._Memory, "once", _stiefel_optimizer._Memory.once))
        _stiefel_optimizer._Memory.once = lambda self, p, text: None
    elif name == "autocast_left_on":
        from fgd_fast import _stiefel_optimizer

        for module in (_stiefel_optimizer, fgd_fast.functional):
            undo.append((module, "autocast_on", module.autocast_on))
            module.autocast_on = lambda: ()
    elif name == "plain_step_after_orthogonal_writes":
        original = fgd_fast.optimizer._fgd

        def writes_first(*args, _before_writes=None, **kwargs):  # the old order: θ and Φ, then the rest
            report = original(*args, **kwargs)
            if _before_writes is not None:
                _before_writes()
            return report

        undo.append((fgd_fast.optimizer, "_fgd", original))
        fgd_fast.optimizer._fgd = writes_first
    elif name == "guard_room_unchecked":
        undo.append((fgd_fast.functional, "check_guard_room", fgd_fast.functional.check_guard_room))
        fgd_fast.functional.check_guard_room = lambda *args: None
    elif name == "fgd_tensor_lr_unchecked":
        original = fgd_fast.functional.check_lr
        undo.append((fgd_fast.functional, "check_lr", original))
        fgd_fast.functional.check_lr = lambda v: v if isinstance(v, torch.Tensor) else original(v)
    elif name == "orthogonal_buffer_unchecked":
        undo.append((fgd_fast.functional, "check_state_tensor", fgd_fast.functional.check_state_tensor))
        fgd_fast.functional.check_state_tensor = lambda *args, **kwargs: None
    elif name == "euclidean_buffer_unchecked":
        from fgd_fast._stiefel_optimizer import StiefelOptimizer

        undo.append((StiefelOptimizer, "_check_sgd_state", StiefelOptimizer._check_sgd_state))
        StiefelOptimizer._check_sgd_state = lambda self, p, label: None
    elif name == "loaded_options_unchecked":
        from fgd_fast._stiefel_optimizer import StiefelOptimizer

        original = StiefelOptimizer._saved_options

        def saved_options(self, saved_groups):
            return {o: saved_groups[0][o] for o in self._OPTIONS if saved_groups and o in saved_groups[0]}

        undo.append((StiefelOptimizer, "_saved_options", original))
        StiefelOptimizer._saved_options = saved_options
    elif name in ("saved_finite_before_cast", "saved_structure_unchecked"):
        from fgd_fast import saved_state

        if name == "saved_finite_before_cast":
            original = saved_state.check_saved_tensor
            new = lambda value, p, text, what, dtype: original(value, p, text, what, value.dtype)  # noqa: E731
            attr = "check_saved_tensor"
        else:
            new, attr = (lambda state_dict: None), "check_saved_structure"
        for module in list(sys.modules.values()):
            if module is not None and module.__name__.startswith("fgd_fast") and hasattr(module, attr):
                undo.append((module, attr, getattr(module, attr)))
                setattr(module, attr, new)
    elif name == "landing_step_overflow_unchecked":
        from fgd_fast.baselines import landing

        original = landing.raise_if_invalid
        undo.append((landing, "raise_if_invalid", original))
        landing.raise_if_invalid = lambda *args, finite_next=None, **kwargs: original(*args, **kwargs)
    elif name == "baseline_state_unchecked":
        from fgd_fast.baselines import LandingSGD

        undo.append((LandingSGD, "_orthogonal_buffers", LandingSGD._orthogonal_buffers))
        LandingSGD._orthogonal_buffers = ()
    elif name == "state_kind_unchecked":
        from fgd_fast._stiefel_optimizer import StiefelOptimizer

        undo.append((StiefelOptimizer, "_check_state_kind", StiefelOptimizer._check_state_kind))
        StiefelOptimizer._check_state_kind = lambda self, p, group, text: None
    elif name == "state_kind_record_lost":
        from fgd_fast._stiefel_optimizer import StiefelOptimizer

        undo.append((StiefelOptimizer, "_record_state_kinds", StiefelOptimizer._record_state_kinds))
        StiefelOptimizer._record_state_kinds = lambda self: self.__dict__.pop("_state_kinds", None)
    elif name == "step_writability_unchecked":
        import fgd_fast._stiefel_optimizer as stiefel

        undo.append((stiefel, "check_writable", stiefel.check_writable))
        stiefel.check_writable = lambda params, labels=None: None
    elif name == "functional_writability_unchecked":
        undo.append((fgd_fast.functional, "check_writable", fgd_fast.functional.check_writable))
        fgd_fast.functional.check_writable = lambda *args, **kwargs: None
    elif name == "step_guard_count_unchecked":
        from fgd_fast._stiefel_optimizer import StiefelOptimizer

        undo.append((fgd_fast.FGD, "_check_orthogonal_state", fgd_fast.FGD._check_orthogonal_state))
        fgd_fast.FGD._check_orthogonal_state = StiefelOptimizer._check_orthogonal_state
    elif name == "saved_guard_count_unchecked":
        from fgd_fast._stiefel_optimizer import StiefelOptimizer

        undo.append((fgd_fast.FGD, "_check_saved_state", fgd_fast.FGD._check_saved_state))
        fgd_fast.FGD._check_saved_state = StiefelOptimizer._check_saved_state
    elif name == "landing_buffer_unchecked":
        from fgd_fast.baselines import landing

        original = landing._finite
        undo.append((landing, "_finite", original))
        landing._finite = lambda grad, buf: original(grad, None)
    elif name == "landing_pull_uncapped":
        from fgd_fast.baselines import landing

        original = landing.safe_step_size

        def uncapped(d, a, attraction, eps):  # the root alone, as the authors' code has it
            lam = attraction
            alpha = -2.0 * d * (lam + a)
            beta = a * a + lam * lam * d**3 + 2.0 * lam * a * d * d + a * a * d
            root = (alpha + torch.sqrt(alpha * alpha + 4.0 * beta * (eps - d))) / (2.0 * beta)
            root = torch.where(beta > 0, root, torch.full_like(root, float("inf")))
            return torch.where(d < eps, root, torch.full_like(root, float("nan")))

        undo.append((landing, "safe_step_size", original))
        landing.safe_step_size = uncapped
    elif name == "cayley_overflow_unchecked":
        from fgd_fast.baselines._base import CayleyBase

        original = CayleyBase._prepare

        def prepare(self, b):
            original(self, b)
            b.finite_next = None

        undo.append((CayleyBase, "_prepare", original))
        CayleyBase._prepare = prepare
    elif name == "cayley_saved_moments_unchecked":
        from fgd_fast.baselines import CayleyADAM
        from fgd_fast.baselines._base import CayleyBase
        from fgd_fast.saved_state import check_saved_tensor, state_dtype

        def buffers_only(self, p, group, state, text):
            for key in ("momentum_buffer", "exp_avg"):
                if state.get(key) is not None:
                    check_saved_tensor(state[key], p, text, key, state_dtype(p, group))

        undo.append((CayleyBase, "_check_saved_state", CayleyBase._check_saved_state))
        undo.append((CayleyADAM, "_check_saved_state", CayleyADAM._check_saved_state))
        CayleyBase._check_saved_state = buffers_only
        CayleyADAM._check_saved_state = buffers_only
    elif name == "step_bound_without_m_squared":

        def step_bound(dist, m, t, layout=None):
            d = dist.to(torch.float64)
            nm, nt, nmt = (layout or Layout.of(m)).norms([m, t, m + t]).to(torch.float64).unbind(0)
            return d + 2.0 * nmt + nm * 2.0 * (d + nt)  # ‖D‖ + 2‖M + T‖ + 2‖M‖(‖D‖ + ‖T‖)

        _replace("step_bound", step_bound, undo)
    elif name == "guard_margin_of_first_p":

        def first_p(self):
            return torch.full((self.count,), float(self.groups[0][1]), dtype=torch.float64, device=self.device)

        from fgd_fast.backends import layout

        undo.append((layout, "_indices", layout._indices))  # (targets memoized before the mutant not reused)
        layout._indices = {}
        undo.append((Layout, "p_per_layer", Layout.p_per_layer))
        Layout.p_per_layer = first_p
    elif name == "row_shard_velocity_unsummed":
        from fgd_fast.backends import torch_groups

        original = torch_groups.reduce_packed
        undo.append((torch_groups, "reduce_packed", original))
        # the call made on every rank, with nothing in it: each rank keeps its own part
        torch_groups.reduce_packed = lambda reduce, chunks, extra: original(reduce, [], extra)
    elif name == "fused_rule_cached_without_radius":
        from fgd_fast.backends import fused_middle

        original = fused_middle._rule

        def rule(lay, radius, limit, unit):  # the table of the first radius seen, for any radius
            return lay.cached(("any-radius", float(limit), float(unit)), lambda: original(lay, radius, limit, unit))

        undo.append((fused_middle, "_rule", original))
        fused_middle._rule = rule
    elif name == "landing_hyper_unchecked":
        from fgd_fast.baselines import landing
        from fgd_fast.validation import check_keys

        undo.append((landing, "_check_group", landing._check_group))
        landing._check_group = lambda group: check_keys(group, landing._GROUP_KEYS)
    elif name == "adapter_options_checked_late":
        from fgd_fast.baselines import adapters

        undo.append((adapters, "_sgd_options", adapters._sgd_options))
        adapters._sgd_options = lambda lr, momentum, weight_decay, nesterov, dampening: dict(
            lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov
        )
    elif name == "cayley_saved_v_any_dtype":
        from fgd_fast.baselines._base import CayleyBase

        original = CayleyBase._check_saved_state

        def any_dtype(self, p, group, state, text):  # (the check sees v cast to float; the load keeps it)
            v = state.get("exp_avg_sq")
            if isinstance(v, torch.Tensor) and not v.is_floating_point():
                state = {**state, "exp_avg_sq": v.double()}
            original(self, p, group, state, text)

        undo.append((CayleyBase, "_check_saved_state", original))
        CayleyBase._check_saved_state = any_dtype
    elif name == "cayley_one_bucket_per_shape":
        from fgd_fast.baselines import CayleyADAM, CayleySGD

        for cls in (CayleySGD, CayleyADAM):
            undo.append((cls, "_bucket_key", cls._bucket_key))
            cls._bucket_key = lambda self, group, state: ()
    elif name in ("carry_ignores_versions", "carry_ignores_addresses", "carry_kept_after_failed_step"):
        from fgd_fast.backends import carry

        original = carry.take

        def take(key, tensors, refresh):
            entry = carry._store.get(key)
            if name == "carry_kept_after_failed_step":  # the entry stays (not popped)
                found = original(key, tensors, refresh)
                if found is not None:
                    carry._store[key] = found
                return found
            if entry is not None and name == "carry_ignores_versions":  # as they are now: every write unseen
                entry.versions = carry._state(tensors)
            elif entry is not None and len(entry.versions) == len(tensors):  # addresses as they are now
                entry.versions = tuple((v, t.data_ptr()) for (v, _), t in zip(entry.versions, tensors))
            return original(key, tensors, refresh)

        undo.append((carry, "take", original))
        carry.take = take

    def remove() -> None:
        for owner, attr, value in reversed(undo):
            if owner is os.environ:
                os.environ.pop(attr, None)
            else:
                setattr(owner, attr, value)

    return remove


def plant_here(name: str) -> None:
    """Plant collective mutant ``name`` in this (rank's) process, for good."""
    before = _module_names()
    try:
        _plant_here(name)
    finally:
        _check_no_name_added(name, before)


def _plant_here(name: str) -> None:
    from fgd_fast import distributed, owners

    if name == "owner_checks_unshared":
        owners._share_checks = lambda checks, group: None
    elif name == "owner_failure_unshared":
        owners._raise_if_an_owner_failed = lambda failed, params, lay: None
    elif name == "strided_layout_unchecked":
        owners._placed_as_the_table_says = lambda params, mine, device, group: [True] * len(params)
    elif name == "gathered_plan_unchecked":
        import dataclasses

        writing_back = distributed._writing_back
        distributed._writing_back = lambda *args: dataclasses.replace(writing_back(*args), guarded=None, dist_next=None)
    elif name == "distance_summed_over_replicas":
        from fgd_fast import manifold

        gram64 = manifold.gram64

        def over_mesh_dim_0(t):
            if not (distributed.is_dtensor(t) and distributed.row_mesh_dim(t) is not None):
                return gram64(t)
            theta = distributed._local_theta(t).to(torch.float64)
            gram = theta.t() @ theta
            distributed.summing_over(t.device_mesh.get_group(0))([gram])()
            return gram

        manifold.gram64 = over_mesh_dim_0
    elif name == "gather_packs_2d_meshes":
        from fgd_fast import collectives

        def first_placement(t):
            if not collectives.is_dtensor(t) or not t.placements[0].is_shard():
                return None
            return t.placements[0].dim

        collectives._one_dim_shard = first_placement
    elif name == "step_refusal_unshared":
        from fgd_fast.optimizer import FGD

        FGD._raise_with_the_ranks = lambda self, error: None
    elif name == "local_checks_unshared":
        import fgd_fast.distributed as distributed

        distributed.agree_on_local_checks = lambda *args, **kwargs: None
    elif name == "sharded_checks_kept_in_groups":
        import fgd_fast.distributed as distributed

        distributed.checks_stay_in_groups = lambda meshes: False
    elif name == "saved_state_unshared":
        import fgd_fast._checkpoint as checkpoint

        def unshared(failed, params):
            if failed is not None:
                raise failed

        checkpoint.agree_on_saved_state = unshared
    elif name == "phi_sq_of_own_rows":
        from fgd_fast.backends import torch_groups
        from fgd_fast.backends.algebra import grad_sq

        torch_groups.Group._phi_sq = lambda self: grad_sq(self._of("bufs"))
    elif name == "grad_sq_unsummed":  # the per-layer ‖g‖² are the only 1-D tensors the row path reduces
        summing = distributed.summing_over

        def summing_over(group):
            reduce = summing(group)

            def partial(tensors):
                return reduce([t for t in tensors if t.dim() != 1])

            partial.bucket_bytes = reduce.bucket_bytes
            return partial

        distributed.summing_over = summing_over
    elif name == "guard_settings_not_agreed":
        agree = distributed.agree_across_ranks
        dropped = ("check_manifold", "max_distance", "guard", "trust_radius", "variant")
        distributed.agree_across_ranks = lambda settings, device, **kw: agree(
            {k: v for k, v in settings.items() if k not in dropped}, device, **kw
        )
    else:
        raise ValueError(f"{name!r} is not planted in the ranks")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    import pytest

    ap = argparse.ArgumentParser(description="run every planted mutant against the tests named for it")
    ap.add_argument("names", nargs="*", default=sorted(MUTANTS))
    ap.add_argument("--json", help="write {mutant: pytest exit status} here")
    args = ap.parse_args(argv)

    def run(nodes: list[str]) -> int:
        # (Triton's cases deselected: the interpreter is slow; a node naming one exactly runs it)
        exact = [n for n in nodes if n.endswith("]")]
        plain = [n for n in nodes if n not in exact]
        base = ["-x", "-q", "-p", "no:cacheprovider"]
        status = int(pytest.main([*base, "-k", "not triton", *plain])) if plain else 0
        return status or (int(pytest.main([*base, *exact])) if exact else 0)

    # the control: every named test passes unmutated in this same process (so a kill below is
    # the mutant's doing, not a leftover of an earlier run)
    status = {"control": run(sorted({n for name in args.names for n in MUTANTS[name][1]}))}
    for name in args.names:
        remove = plant(name)
        try:
            status[name] = run(MUTANTS[name][1])
        finally:
            remove()
    print(json.dumps(status))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(status, f)
    return 0 if status.pop("control") == 0 and all(v == 1 for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
