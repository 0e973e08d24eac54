/* bfloat16 bit patterns (uint16) to and from float32: shared by the GEMMs (panel.h) and the decode step. */
#ifndef ODMA_BF16_H
#define ODMA_BF16_H

#include <stdint.h>
#include <string.h>

/* fp32 → bf16, rounding to nearest even (a quiet NaN stays a NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
