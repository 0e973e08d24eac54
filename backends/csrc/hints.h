/* Compiler hints the kernels share: a prefetch that never faults, and inlining forced where a kernel specialises on
 * constant arguments. */
#ifndef ODMA_HINTS_H
#define ODMA_HINTS_H

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define PREFETCH(p) ((void)(p))
#define ALWAYS_INLINE static inline
#endif
#define LINE_FLOATS 16 /* one 64-byte cache line */

#endif
