/* An open-addressing map (a, b) -> int32 for the prefix index's C core: linear probing, kept at most half full,
   deletion by backward shift (no tombstones, so a long-lived table does not slow down as entries come and go). */

#ifndef PDSERVE_KV_INDEX_MAP_H
#define PDSERVE_KV_INDEX_MAP_H

#include <Python.h>
#include <stdint.h>

typedef struct { uint64_t a, b; int32_t val; int32_t used; } Slot;
typedef struct { Slot *slots; size_t mask, len; } Map;

static inline uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t x = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x632BE59BD9B4E019ULL + (a << 6) + (a >> 2));
    x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ULL; x ^= x >> 29; x *= 0x94D049BB133111EBULL; x ^= x >> 32;
    return x;
}

static inline int map_init(Map *m, size_t cap) {
    m->slots = PyMem_Calloc(cap, sizeof(Slot));
    m->mask = cap - 1;
    m->len = 0;
    return m->slots ? 0 : -1;
}

static inline Slot *map_find(Map *m, uint64_t a, uint64_t b) {
    size_t i = mix(a, b) & m->mask;
    for (;;) {
        Slot *s = &m->slots[i];
        if (!s->used) return NULL;
        if (s->a == a && s->b == b) return s;
        i = (i + 1) & m->mask;
    }
}

static inline int map_grow(Map *m) {
    Map bigger;
    if (map_init(&bigger, (m->mask + 1) * 2) < 0) return -1;
    for (size_t i = 0; i <= m->mask; i++) {
        Slot *s = &m->slots[i];
        if (!s->used) continue;
        size_t j = mix(s->a, s->b) & bigger.mask;
        while (bigger.slots[j].used) j = (j + 1) & bigger.mask;
        bigger.slots[j] = *s;
    }
    bigger.len = m->len;
    PyMem_Free(m->slots);
    *m = bigger;
    return 0;
}

/* The slot for (a, b), added with `val` when absent (kept below 1/2 full); NULL on no memory. */
static inline Slot *map_put(Map *m, uint64_t a, uint64_t b, int32_t val) {
    if ((m->len + 1) * 2 > m->mask + 1 && map_grow(m) < 0) return NULL;
    size_t i = mix(a, b) & m->mask;
    for (;;) {
        Slot *s = &m->slots[i];
        if (!s->used) {
            s->a = a; s->b = b; s->val = val; s->used = 1;
            m->len++;
            return s;
        }
        if (s->a == a && s->b == b) return s;
        i = (i + 1) & m->mask;
    }
}

static inline void map_del(Map *m, Slot *s) {
    size_t hole = (size_t)(s - m->slots), i = hole;
    m->slots[hole].used = 0;
    m->len--;
    for (;;) {  /* move back every later entry of the run that probing could not find past the hole */
        i = (i + 1) & m->mask;
        Slot *next = &m->slots[i];
        if (!next->used) return;
        size_t home = mix(next->a, next->b) & m->mask;
        if (((i - home) & m->mask) >= ((i - hole) & m->mask)) {
            m->slots[hole] = *next;
            next->used = 0;
            hole = i;
        }
    }
}

#endif
