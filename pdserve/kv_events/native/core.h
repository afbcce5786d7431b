/* The prefix index's C core: its state, shared by the event code (core.c) and the Python type (module.c). */

#ifndef PDSERVE_KV_INDEX_CORE_H
#define PDSERVE_KV_INDEX_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "map.h"

#define NONE_ID (-1)

typedef struct {
    uint64_t key, ekey;
    int32_t block_size, member, device, offload;
    int32_t prev, next;  /* the LRU's neighbours (oldest first); `next` chains the free entries */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    int32_t n_entries, entries_cap, free_head, lru_head, lru_tail, lru_len;
    Map blocks;      /* (member, engine hash) -> entry */
    Map entries_of;  /* (member << 32 | block size, content key) -> how many of its entries hold that content */
    PyObject **names;  /* member id -> name (the holders' and credits' dict key) */
    Py_ssize_t *held;  /* member id -> its entries */
    int32_t n_members;
    Py_ssize_t capacity;
    long long orphans, evicted;
    PyObject *holders, *speculative;  /* the Python index's dicts */
    PyObject *one, *offload_weight;   /* the credits a device copy and another tier's copy give */
    PyObject *stored_type, *removed_type, *cleared_type, *storage_medium, *device_medium;
} Core;

int core_init_names(void);  /* the event fields' interned names; once, at import */
int check_member(Core *c, int member);
int forget_member(Core *c, int32_t member);
PyObject *Core_apply(Core *c, PyObject *args);
/* query.c: what routing asks (the functions of the module) */
PyObject *content_keys(PyObject *module, PyObject *args);
PyObject *known_run(PyObject *module, PyObject *args);
PyObject *overlap(PyObject *module, PyObject *args);
PyObject *credit(PyObject *module, PyObject *args);

#endif
