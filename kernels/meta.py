"""Names shared by the Triton kernels and their launcher: metadata fields, block slots, modes.

Plain ``int`` constants: ``@triton.jit`` code reads them as attributes of this module
(``meta.F_N``), which Triton folds as compile-time constants.

**Metadata table** (``int64``, ``META_FIELDS`` columns, one row per layer):

    θ ptr, Φ ptr (0 if absent), g ptr, hi ptr, lo ptr (0 if unused), n, p, ld,
    Gram offset, M offset, rows per split

``hi``/``lo`` are the TF32 split of θ written by the tensor-core step's split pass (θ's layout,
the n dimension padded to ``ld`` rows with zeros); the FMA kernels leave them 0.

**Block order** (every fused backend, Triton and CUDA): per layer the Gram blocks
``[A | E | B | C]`` (Triton: ``+ G | H`` for the guard, ``+ L`` for the split products), each
``p × p`` in the accumulation type, and the update matrices ``[M_θ | M_Φ]`` (CUDA; the Triton
update kernels read M_θ and M_Φ from the middle's two buffers, at ``F_M``: the sum of the p²
of the layers before).
"""

from __future__ import annotations

# metadata fields (columns of the int64 table)
F_THETA = 0
F_PHI = 1
F_GRAD = 2
F_HI = 3
F_LO = 4
F_N = 5
F_P = 6
F_LD = 7
F_GRAM = 8
F_M = 9
F_CHUNK = 10
META_FIELDS = 11
FIELD_NAMES = ("THETA", "PHI", "GRAD", "HI", "LO", "N", "P", "LD", "GRAM", "M", "CHUNK")

# Gram slots: A = θᵀθ, E = θᵀg, B = θᵀΦ, C = ΦᵀΦ, and for the guard's UᵀU G = gᵀg, H = Φᵀg or
# its transpose (only H + Hᵀ enters; the kernels store gᵀΦ) (and L = hiᵀlo, tensor-core tf32x3 only)
SLOT_A = 0
SLOT_E = 1
SLOT_B = 2
SLOT_C = 3
SLOT_G = 4
SLOT_H = 5
SLOT_L = 6
GRAM_SLOTS = 6  # slots of the FMA kernels (A, E, B, C, G, H)
TC_GRAM_SLOTS = 7  # slots of the tensor-core kernels (A, E, B, C, G, H, L)

# update matrices: θ₊ = θ + V + θ M_θ, Φ₊ = U + θ M_Φ (slot of each in the update's tables)
M_THETA = 0
M_PHI = 1

# work-table columns (int32) of the tensor-core kernels
G_LAYER, G_LEFT, G_RIGHT, G_SLOT, G_TI, G_TJ, G_SPLIT = range(7)  # Gram: fields of X, Y; slot of XᵀY
GRAM_WORK = 7
S_LAYER, S_TI, S_TK = range(3)  # split: tile along p, tile along the padded n
SPLIT_WORK = 3
U_LAYER, U_RB, U_CB = range(3)  # update: row block, column block
UPDATE_WORK = 3

# the per-layer hyper-parameter table (accumulation type, HYPER_FIELDS columns): η, β, α
H_LR, H_BETA, H_ALPHA = range(3)
HYPER_FIELDS = 3

# rows of the tensor-core split buffers (hi, lo): n padded to a multiple of this, so every hi/lo
# row (and every layer's block, at offsets Σ p·ld) starts 16-byte aligned; ≥ every BK and BR used
LD_ALIGN = 128

# the Gram blocks' gather into the middle's layout (blocks.py): per layer (int64) the layout
# offset, p and the offset of the layer's blocks in the Gram slabs
GG_OFF, GG_P, GG_SRC = range(3)
GG_FIELDS = 3

# the middle's products (products.py): per layer (int64) the layout offset and p
MM_OFF, MM_P = range(2)
MM_FIELDS = 2

# the guard's blend kernels (guard.py): work items (layer, tile i, tile j) like the update's
GB_WEIGHTS = 15  # the positive weights 2^(−k/2), k = 0…14 (fgd_fast.backends.guard_rule.WEIGHTS)
GB_PART = 19  # partial sums per item: 15 distances², ‖D₀‖², ‖D_ns‖², Σ 0·X₂ + Σ 0·M_Φ, ‖D‖²
GB_PART_PAD = 32  # the partial row as a power-of-two vector
GB_L_OFF, GB_L_P, GB_L_FIRST, GB_L_ITEMS = range(4)  # per layer (int64): block offset, p, first item, items
GB_LAYER_FIELDS = 4
GB_C_ALPHA, GB_C_TARGET, GB_C_LR, GB_C_BETA = range(4)  # per layer (float64): α, target, η, β
GB_COEF_FIELDS = 4
# per layer (float64): first a step's checks as the optimizer reads them (‖θᵀθ − I‖_F now, the
# inputs finite (0/1), the step's distance, θ₊ storable in the parameters' dtype (0/1), guards
# code: KEPT 0 / SCALED 1 / RESET 2), then t, Newton–Schulz (0/1) and the update's scale ts
GB_R_DIST0, GB_R_FINITE, GB_R_DIST, GB_R_FITS, GB_R_CODE, GB_R_WEIGHT, GB_R_NEWTON, GB_R_SCALE = range(8)
GB_RESULT_FIELDS = 8
GB_R_CHECKS = 5  # the first five: a step plan's check table (fgd_fast.backends.base.StepPlan.checks)
GB_W_GIVEN, GB_W_G, GB_W_CHG = range(3)  # W = s²UᵀU: a block, or η²G (no Φ), or η²G + β²C − βη(H + Hᵀ)

# the fused middle (middle.py, products.py' mid_jobs_kernel, fgd_fast/backends/fused_middle.py): one
# buffer of MP_SLOTS blocks of the layout; the Gram blocks' slots (SLOT_A … SLOT_H) first, then the
# prologue's B' = sB, S' = sym(sB), Q (the M_Φ bracket's elementwise terms), T = θᵀ(sU)
MP_B, MP_S, MP_Q, MP_T = range(6, 10)
MP_SLOTS = 10
MP_RULE_RADIUS, MP_RULE_TARGET = range(2)  # the guard's per-layer rule (float64): ρ, the target distance
MP_RULE_FIELDS = 2
# a product job of mid_jobs_kernel (int64 row): out = Z + γ·ZTᵀ + α·op(X)·Y (op(X) = Xᵀ where TX),
# and out2 = out + ADD2 where OUT2 ≥ 0; operands as slots of the buffer (−1: none), α and γ as codes
MJ_X, MJ_Y, MJ_Z, MJ_ZT, MJ_OUT, MJ_OUT2, MJ_ADD2, MJ_TX, MJ_ALPHA, MJ_GAMMA = range(10)
MJ_FIELDS = 10
MJ_WORK = 4  # work-table columns (int32): job, layer, tile i, tile j
COEF_ONE, COEF_MINUS_ONE, COEF_MINUS_ALPHA = range(3)  # α, γ: 1, −1, or the layer's −α (hyper table)

# update modes of the FMA update kernel
MODE_PHI = 0  # Φ₊ = U + θ M_Φ
MODE_THETA = 1  # θ₊ = θ + V + θ M


def meta_row(**fields) -> list[int]:
    """One metadata row built by name: ``meta_row(THETA=ptr, N=n, ...)``; absent fields are 0."""
    row = [0] * META_FIELDS
    for name, value in fields.items():
        row[FIELD_NAMES.index(name)] = int(value)
    return row


#: guard_rule.MIN_TRUST_SCALE, float32's smallest normal number (a test checks they agree): below it the
#: middle kernel resets a layer
MIN_TRUST_SCALE = 2.0**-126
