/* One 32-input block of a 6 x 32 vpdpbusd tile, shared by cpu_q32.c and cpu_greedy_head.c,
 * and the next panel's prefetch shares (cpu_q32.c's AVX2 tiles too). Included after
 * <immintrin.h> and <string.h>. */
#ifndef PAGELLM_Q32_BLOCK_H
#define PAGELLM_Q32_BLOCK_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* s[r][0..1] += block g's byte products for rows [0, RB) (x: their bytes, row stride K) x a
 * panel's 32 outputs (cb: the block's codes, [8][32][4] bytes: 4 consecutive inputs of an
 * output a lane; NIB: 4-bit codes two a byte, [8][16][4], outputs o and o + 16 in a byte's
 * low and high nibble). codes_unsigned: the codes are vpdpbusd's unsigned operand and the
 * activations its signed one (q32: u8 codes, int8 activations), else the reverse (the greedy
 * head: Q8_0's int8 codes, activations + 128). Meanwhile this block's share of npf cache
 * lines from pf (G blocks share them) goes into L1. */
static inline __attribute__((always_inline)) void block_products(
        int RB, int codes_unsigned, int NIB, const void *x, int64_t K, int64_t g, int64_t G,
        const void *cb, __m512i s[][2], const char *pf, int64_t npf) {
    for (int64_t l = g * npf / G; l < (g + 1) * npf / G; l++)
        _mm_prefetch(pf + l * 64, _MM_HINT_T0);
    for (int kq = 0; kq < 8; kq++) {
        __m512i w0, w1;
        if (NIB) {  /* two shifts and masks: on pipes the products leave free */
            const __m512i pk = _mm512_loadu_si512((const char *)cb + kq * 64);
            w0 = _mm512_and_si512(pk, _mm512_set1_epi8(0x0F));
            w1 = _mm512_and_si512(_mm512_srli_epi16(pk, 4), _mm512_set1_epi8(0x0F));
        } else {
            w0 = _mm512_loadu_si512((const char *)cb + kq * 128);
            w1 = _mm512_loadu_si512((const char *)cb + kq * 128 + 64);
        }
        for (int r = 0; r < RB; r++) {
            int32_t word;
            memcpy(&word, (const char *)x + r * K + g * 32 + kq * 4, 4);
            const __m512i xb = _mm512_set1_epi32(word);
            if (codes_unsigned) {
                s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, xb);
                s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, xb);
            } else {
                s[r][0] = _mm512_dpbusd_epi32(s[r][0], xb, w0);
                s[r][1] = _mm512_dpbusd_epi32(s[r][1], xb, w1);
            }
        }
    }
}

#endif

/* The next panel's codes (`bytes`: 32 K, or 16 K in nibbles) go into L1 while a panel's
 * rows [0, rows) pass in tiles of TR: tile r / TR sends its share, lines [*first, *first +
 * the count returned), so that each line goes once a panel; none after the last panel
 * (`last`). */
static inline int64_t next_panel_share(int64_t bytes, int64_t TR, int64_t rows, int64_t r,
                                       int last, int64_t *first) {
    const int64_t lines = bytes / 64, tiles = (rows + TR - 1) / TR;
    const int64_t per = (lines + tiles - 1) / tiles, from = r / TR * per;
    *first = from;
    return last || from >= lines ? 0 : from + per <= lines ? per : lines - from;
}

#endif
