// CPU emulation (tests only): __nv_bfloat16 as 16 bits of storage with exact conversions
// (round to nearest even; NaN stays a quiet NaN). Checked against torch by the tests.
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 b) {
    const uint32_t u = (uint32_t)b.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN
        r.bits = (uint16_t)((u >> 16) | 0x0040u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (overflow → inf, as it should)
    r.bits = (uint16_t)(u >> 16);
    return r;
}
