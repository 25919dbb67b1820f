// CPU emulation (tests only): __half as 16 bits of storage with exact IEEE conversions
// (round to nearest even, subnormals, ±inf, NaN), as the device intrinsics compute them.
// Done in integer arithmetic so the result depends on no compiler's _Float16 support;
// tests/test_cuda_emulated.py checks both directions against torch over every half value.
#pragma once

#include <cstdint>
#include <cstring>

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
    const uint32_t exp = (h.bits >> 10) & 0x1fu;
    uint32_t man = h.bits & 0x3ffu;
    uint32_t out;
    if (exp == 0x1f) {  // inf / NaN (payload kept, made quiet)
        out = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    } else if (exp != 0) {  // normal
        out = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {  // ±0
        out = sign;
    } else {  // subnormal: normalise
        int e = 113;  // 127 − 14
        while (!(man & 0x400u)) {
            man <<= 1;
            --e;
        }
        out = sign | ((uint32_t)e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &out, 4);
    return f;
}

inline __half __float2half_rn(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    __half h;
    if (ax > 0x7f800000u) {  // NaN: quiet, top payload bits kept
        h.bits = sign | 0x7e00u | (uint16_t)((ax >> 13) & 0x1ffu);
    } else if (ax >= 0x477ff000u) {  // >= 65520 (and inf) rounds to inf
        h.bits = sign | 0x7c00u;
    } else if (ax >= 0x38800000u) {  // normal half: drop 13 mantissa bits, round to nearest even
        uint32_t r = ((ax >> 23) - 112u) << 10 | ((ax & 0x7fffffu) >> 13);
        const uint32_t rest = ax & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;  // a carry moves the exponent: right
        h.bits = sign | (uint16_t)r;
    } else if (ax <= 0x33000000u) {  // <= 2^-25: rounds to ±0 (2^-25 is a tie, 0 is even)
        h.bits = sign;
    } else {  // subnormal half: units of 2^-24
        const uint32_t man = (ax & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(ax >> 23);  // 14 … 24
        uint32_t r = man >> shift;
        const uint32_t rest = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (r & 1u))) ++r;  // may carry into the smallest normal
        h.bits = sign | (uint16_t)r;
    }
    return h;
}
