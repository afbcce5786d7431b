/* The prefix index's event application in C: what a KV event batch does to the index, block by block.

   The Python index (pdserve/kv_events/index.py) owns what routing reads: the holders (block size -> content key
   -> {member: credit}) and the speculative credits (block size -> content key -> {member: expiry}), plain dicts.
   This core owns what only event application reads: each member's entries by engine hash, how many of a member's
   entries hold one content key, and the LRU over all entries. It writes the holders and drops confirmed credits
   through the dict API, so both cores leave the same dicts behind (the tests compare them), and routing's code
   is the same whichever core runs. tests/test_kv_index_native.py holds this core to the Python one.

   Engine hashes are folded to 64 bits: integers by their low 64 bits (a signed hash names the unsigned one with its
   bits, as in the Python core); byte digests by XXH3-64 of the digest. vLLM's own default hash is already the low
   64 bits of its digest, so the fold loses nothing vLLM keeps; two digests that agree in 64 bits would be one
   entry (one pair in 2^64). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define ROOT_KEY 1337ULL /* the chain's seed, as the Python core's */
#define NONE_ID (-1)

/* -- an open-addressing map (a, b) -> int32, linear probing, deletion by backward shift ------------------------ */
typedef struct { uint64_t a, b; int32_t val; int32_t used; } Slot;
typedef struct { Slot *slots; size_t mask, len; } Map;

static inline uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t x = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x632BE59BD9B4E019ULL + (a << 6) + (a >> 2));
    x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ULL; x ^= x >> 29; x *= 0x94D049BB133111EBULL; x ^= x >> 32;
    return x;
}

static int map_init(Map *m, size_t cap) {
    m->slots = PyMem_Calloc(cap, sizeof(Slot));
    m->mask = cap - 1;
    m->len = 0;
    return m->slots ? 0 : -1;
}

static Slot *map_find(Map *m, uint64_t a, uint64_t b) {
    size_t i = mix(a, b) & m->mask;
    for (;;) {
        Slot *s = &m->slots[i];
        if (!s->used) return NULL;
        if (s->a == a && s->b == b) return s;
        i = (i + 1) & m->mask;
    }
}

static int map_grow(Map *m) {
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
static Slot *map_put(Map *m, uint64_t a, uint64_t b, int32_t val) {
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

static void map_del(Map *m, Slot *s) {
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

/* -- entries and the LRU ---------------------------------------------------------------------------------------- */
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

static PyObject *s_block_hashes, *s_parent, *s_token_ids, *s_block_size, *s_medium;

static int32_t entry_new(Core *c) {
    if (c->free_head != NONE_ID) {
        int32_t id = c->free_head;
        c->free_head = c->entries[id].next;
        return id;
    }
    if (c->n_entries == c->entries_cap) {
        if (c->entries_cap > INT32_MAX / 2) return NONE_ID;
        int32_t cap = c->entries_cap ? c->entries_cap * 2 : 1024;
        Entry *grown = PyMem_Realloc(c->entries, (size_t)cap * sizeof(Entry));
        if (!grown) return NONE_ID;
        c->entries = grown;
        c->entries_cap = cap;
    }
    return c->n_entries++;
}

static void lru_unlink(Core *c, int32_t id) {
    Entry *e = &c->entries[id];
    if (e->prev != NONE_ID) c->entries[e->prev].next = e->next; else c->lru_head = e->next;
    if (e->next != NONE_ID) c->entries[e->next].prev = e->prev; else c->lru_tail = e->prev;
    c->lru_len--;
}

static void lru_push(Core *c, int32_t id) {
    Entry *e = &c->entries[id];
    e->prev = c->lru_tail;
    e->next = NONE_ID;
    if (c->lru_tail != NONE_ID) c->entries[c->lru_tail].next = id; else c->lru_head = id;
    c->lru_tail = id;
    c->lru_len++;
}

/* d[k], added as a new dict when absent (a borrowed reference); NULL with an exception on failure. */
static PyObject *dict_child(PyObject *d, PyObject *k) {
    PyObject *child = PyDict_GetItemWithError(d, k);
    if (child || PyErr_Occurred()) return child;
    child = PyDict_New();
    if (!child) return NULL;
    int failed = PyDict_SetItem(d, k, child);
    Py_DECREF(child);
    return failed ? NULL : child;
}

/* Remove `member` from the inner dict d[k1][k2] (if there), and d[k1][k2] itself once empty. */
static int dict_unset(PyObject *d, PyObject *k1, PyObject *k2, PyObject *member) {
    PyObject *by_key = PyDict_GetItemWithError(d, k1);
    if (!by_key) return PyErr_Occurred() ? -1 : 0;
    PyObject *inner = PyDict_GetItemWithError(by_key, k2);
    if (!inner) return PyErr_Occurred() ? -1 : 0;
    int has = PyDict_Contains(inner, member);
    if (has < 0 || (has && PyDict_DelItem(inner, member) < 0)) return -1;
    if (PyDict_GET_SIZE(inner) == 0 && PyDict_DelItem(by_key, k2) < 0) return -1;
    return 0;
}

/* holders[bs][key][member] = the entry's credit */
static int set_holder(Core *c, Entry *e, PyObject *bs, PyObject *key) {
    PyObject *by_key = dict_child(c->holders, bs);
    PyObject *inner = by_key ? dict_child(by_key, key) : NULL;
    if (!inner) return -1;
    return PyDict_SetItem(inner, c->names[e->member], e->device ? c->one : c->offload_weight);
}

static int forget(Core *c, int32_t id) {
    Entry *e = &c->entries[id];
    Slot *s = map_find(&c->blocks, (uint64_t)e->member, e->ekey);
    if (s) map_del(&c->blocks, s);
    lru_unlink(c, id);
    c->held[e->member]--;
    int rc = 0;
    uint64_t content = (uint64_t)e->member << 32 | (uint32_t)e->block_size;
    s = map_find(&c->entries_of, content, e->key);
    if (s && --s->val > 0) goto done;  /* another of its entries holds these tokens: it still holds them */
    if (s) map_del(&c->entries_of, s);
    PyObject *bs = PyLong_FromLong(e->block_size), *key = PyLong_FromUnsignedLongLong(e->key);
    rc = bs && key ? dict_unset(c->holders, bs, key, c->names[e->member]) : -1;
    Py_XDECREF(bs);
    Py_XDECREF(key);
done:
    e->next = c->free_head;
    c->free_head = id;
    return rc;
}

static int trim(Core *c) {
    while (c->lru_len > c->capacity) {
        c->evicted++;
        if (forget(c, c->lru_head) < 0) return -1;
    }
    return 0;
}

static int engine_key(PyObject *h, uint64_t *out) {
    if (PyLong_CheckExact(h)) {
        *out = PyLong_AsUnsignedLongLongMask(h);
        return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
    }
    if (PyBytes_Check(h)) {
        *out = XXH3_64bits(PyBytes_AS_STRING(h), (size_t)PyBytes_GET_SIZE(h));
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "a block hash must be an int or bytes, not %.50s", Py_TYPE(h)->tp_name);
    return -1;
}

static int is_device(Core *c, PyObject *medium) {
    return medium == Py_None || PyObject_RichCompareBool(medium, c->device_medium, Py_EQ);
}

/* One more copy of an entry: credited, and the newest in the LRU. */
static int add_copy(Core *c, int32_t id, int device, PyObject *bs, PyObject *key) {
    Entry *e = &c->entries[id];
    if (device) e->device++; else e->offload++;
    lru_unlink(c, id);
    lru_push(c, id);
    return set_holder(c, e, bs, key);
}

/* -- the events ----------------------------------------------------------------------------------------------------- */
static int announce(Core *c, int32_t member, PyObject *hashes, int device) {
    /* a tier announcing blocks it took over: only hashes the index already knows */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++) {
        uint64_t ekey;
        if (engine_key(PyList_GET_ITEM(hashes, i), &ekey) < 0) return -1;
        Slot *s = map_find(&c->blocks, (uint64_t)member, ekey);
        if (!s) continue;
        Entry *e = &c->entries[s->val];
        PyObject *bs = PyLong_FromLong(e->block_size), *key = PyLong_FromUnsignedLongLong(e->key);
        int rc = bs && key ? add_copy(c, s->val, device, bs, key) : -1;
        Py_XDECREF(bs);
        Py_XDECREF(key);
        if (rc < 0 || trim(c) < 0) return -1;
    }
    return 0;
}

/* Drop `member`'s credit for content (bs, key), which its events now confirm. */
static int unguess(Core *c, int32_t member, PyObject *guesses, PyObject *bs, PyObject *key) {
    PyObject *pair = PyTuple_Pack(2, bs, key);
    if (!pair) return -1;
    int has = PyDict_Contains(guesses, pair);
    int rc = has < 0 ? -1 : 0;
    if (has > 0) {
        rc = PyDict_DelItem(guesses, pair);
        if (rc == 0) rc = dict_unset(c->speculative, bs, key, c->names[member]);
    }
    Py_DECREF(pair);
    return rc;
}

/* Returns the block size stored (0: none), -1 on error. */
static long stored(Core *c, int32_t member, PyObject *event, PyObject *guesses, int device) {
    long result = -1;
    PyObject *hashes = PyObject_GetAttr(event, s_block_hashes), *tokens = PyObject_GetAttr(event, s_token_ids);
    PyObject *bs_obj = PyObject_GetAttr(event, s_block_size), *parent = PyObject_GetAttr(event, s_parent);
    uint32_t *ids = NULL;
    if (!hashes || !tokens || !bs_obj || !parent) goto out;
    if (!PyList_Check(hashes) || !PyList_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "block_hashes and token_ids must be lists");
        goto out;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes), n_tokens = PyList_GET_SIZE(tokens);
    if (n_tokens == 0) {
        result = announce(c, member, hashes, device) < 0 ? -1 : 0;
        goto out;
    }
    long bs = PyLong_AsLong(bs_obj);
    if (bs == -1 && PyErr_Occurred()) goto out;
    result = 0;
    if (bs < 1 || bs > INT32_MAX / 4 || n_tokens != bs * n) {
        c->orphans += n;
        goto out;
    }
    uint64_t parent_key = ROOT_KEY;
    if (parent != Py_None) {
        uint64_t pkey;
        if (engine_key(parent, &pkey) < 0) { result = -1; goto out; }
        Slot *s = map_find(&c->blocks, (uint64_t)member, pkey);
        if (!s || c->entries[s->val].block_size != bs) {
            c->orphans += n;
            goto out;
        }
        parent_key = c->entries[s->val].key;
    }
    ids = PyMem_Malloc((size_t)n_tokens * sizeof(uint32_t));
    if (!ids) { result = -1; PyErr_NoMemory(); goto out; }
    for (Py_ssize_t i = 0; i < n_tokens; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(tokens, i));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > UINT32_MAX) {  /* no token id of any vocabulary */
            PyErr_Clear();
            c->orphans += n;
            goto out;
        }
        ids[i] = (uint32_t)v;
    }
    result = bs;
    int guessing = guesses != Py_None && PyDict_GET_SIZE(guesses) > 0;
    uint64_t content = (uint64_t)member << 32 | (uint32_t)bs;
    for (Py_ssize_t i = 0; i < n; i++) {
        parent_key = XXH3_64bits_withSeed(ids + i * bs, (size_t)bs * 4, parent_key);
        uint64_t ekey;
        if (engine_key(PyList_GET_ITEM(hashes, i), &ekey) < 0) { result = -1; goto out; }
        Slot *s = map_find(&c->blocks, (uint64_t)member, ekey);
        int32_t id = s ? s->val : NONE_ID;
        if (id != NONE_ID && c->entries[id].key != parent_key) {  /* the engine reused the hash for other tokens */
            if (forget(c, id) < 0) { result = -1; goto out; }
            id = NONE_ID;
        }
        if (id == NONE_ID) {
            id = entry_new(c);
            Slot *counted = id == NONE_ID ? NULL : map_put(&c->entries_of, content, parent_key, 0);
            if (!counted || !map_put(&c->blocks, (uint64_t)member, ekey, id)) { PyErr_NoMemory(); result = -1; goto out; }
            counted->val++;
            c->entries[id] = (Entry){parent_key, ekey, (int32_t)bs, member, 0, 0, NONE_ID, NONE_ID};
            lru_push(c, id);
            c->held[member]++;
        }
        PyObject *key = PyLong_FromUnsignedLongLong(parent_key);
        int rc = key ? add_copy(c, id, device, bs_obj, key) : -1;
        if (rc == 0 && guessing) rc = unguess(c, member, guesses, bs_obj, key);
        Py_XDECREF(key);
        if (rc < 0) { result = -1; goto out; }
    }
    if (trim(c) < 0) result = -1;
out:
    PyMem_Free(ids);
    Py_XDECREF(hashes);
    Py_XDECREF(tokens);
    Py_XDECREF(bs_obj);
    Py_XDECREF(parent);
    return result;
}

static int removed(Core *c, int32_t member, PyObject *event, int device) {
    PyObject *hashes = PyObject_GetAttr(event, s_block_hashes);
    if (!hashes) return -1;
    int rc = 0;
    if (!PyList_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "block_hashes must be a list");
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(hashes); i++) {
        uint64_t ekey;
        if (engine_key(PyList_GET_ITEM(hashes, i), &ekey) < 0) { rc = -1; break; }
        Slot *s = map_find(&c->blocks, (uint64_t)member, ekey);
        if (!s) continue;
        int32_t id = s->val;
        Entry *e = &c->entries[id];
        if (device) { if (e->device) e->device--; }
        else if (e->offload) e->offload--;
        if (e->device || e->offload) {
            PyObject *bs = PyLong_FromLong(e->block_size), *key = PyLong_FromUnsignedLongLong(e->key);
            rc = bs && key ? set_holder(c, e, bs, key) : -1;
            Py_XDECREF(bs);
            Py_XDECREF(key);
        } else {
            rc = forget(c, id);
        }
    }
    Py_DECREF(hashes);
    return rc;
}

static int forget_member(Core *c, int32_t member) {
    for (int32_t id = c->lru_head; id != NONE_ID;) {
        int32_t next = c->entries[id].next;
        if (c->entries[id].member == member && forget(c, id) < 0) return -1;
        id = next;
    }
    return 0;
}

/* -- the Python interface ------------------------------------------------------------------------------------------ */
static int check_member(Core *c, int member) {
    if (member < 0 || member >= c->n_members) {
        PyErr_Format(PyExc_IndexError, "no member %d", member);
        return -1;
    }
    return 0;
}

static PyObject *Core_apply(Core *c, PyObject *args) {
    PyObject *events, *guesses, *store_guesses;
    int member, store;
    if (!PyArg_ParseTuple(args, "OiOiO", &events, &member, &guesses, &store, &store_guesses)) return NULL;
    if (check_member(c, member) < 0 || (store != NONE_ID && check_member(c, store) < 0)) return NULL;
    PyObject *seq = PySequence_Fast(events, "events must be a sequence");
    if (!seq) return NULL;
    long n_stored = 0, n_removed = 0, n_cleared = 0, bs_mine = 0, bs_store = 0, got;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *event = PySequence_Fast_GET_ITEM(seq, i);
        PyTypeObject *type = Py_TYPE(event);
        if (type == (PyTypeObject *)c->cleared_type) {  /* the engine's cache; a store it writes keeps its blocks */
            n_cleared++;
            if (forget_member(c, member) < 0) goto fail;
            continue;
        }
        if (type != (PyTypeObject *)c->stored_type && type != (PyTypeObject *)c->removed_type) continue;
        PyObject *medium = PyObject_GetAttr(event, s_medium);
        if (!medium) goto fail;
        int to_store = store != NONE_ID && medium != Py_None &&
                       PyObject_RichCompareBool(medium, c->storage_medium, Py_EQ) == 1;
        int device = is_device(c, medium);
        Py_DECREF(medium);
        if (device < 0) goto fail;
        int32_t who = to_store ? store : member;
        if (type == (PyTypeObject *)c->removed_type) {
            n_removed++;
            if (removed(c, who, event, device) < 0) goto fail;
        } else {
            n_stored++;
            if ((got = stored(c, who, event, to_store ? store_guesses : guesses, device)) < 0) goto fail;
            if (got) { if (to_store) bs_store = got; else bs_mine = got; }
        }
    }
    Py_DECREF(seq);
    return Py_BuildValue("(lllll)", n_stored, n_removed, n_cleared, bs_mine, bs_store);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Core_add_member(Core *c, PyObject *name) {
    PyObject **names = PyMem_Realloc(c->names, (size_t)(c->n_members + 1) * sizeof(PyObject *));
    if (!names) return PyErr_NoMemory();
    c->names = names;
    Py_ssize_t *held = PyMem_Realloc(c->held, (size_t)(c->n_members + 1) * sizeof(Py_ssize_t));
    if (!held) return PyErr_NoMemory();
    c->held = held;
    Py_INCREF(name);
    c->names[c->n_members] = name;
    c->held[c->n_members] = 0;
    return PyLong_FromLong(c->n_members++);
}

static PyObject *Core_forget_member(Core *c, PyObject *arg) {
    int member = (int)PyLong_AsLong(arg);
    if ((member == -1 && PyErr_Occurred()) || check_member(c, member) < 0 || forget_member(c, member) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_held(Core *c, PyObject *arg) {
    int member = (int)PyLong_AsLong(arg);
    if ((member == -1 && PyErr_Occurred()) || check_member(c, member) < 0) return NULL;
    return PyLong_FromSsize_t(c->held[member]);
}

static PyObject *Core_lru_items(Core *c, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    for (int32_t id = c->lru_head; out && id != NONE_ID; id = c->entries[id].next) {
        PyObject *item = Py_BuildValue("(OK)", c->names[c->entries[id].member], c->entries[id].ekey);
        if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

static PyObject *Core_counters(Core *c, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("(nLL)", (Py_ssize_t)c->lru_len, c->orphans, c->evicted);
}

static int Core_init(Core *c, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"holders", "speculative", "capacity", "offload_weight", "stored_type", "removed_type",
                         "cleared_type", NULL};
    double weight;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!ndOOO", kw, &PyDict_Type, &c->holders, &PyDict_Type,
                                     &c->speculative, &c->capacity, &weight, &c->stored_type, &c->removed_type,
                                     &c->cleared_type))
        return -1;
    Py_INCREF(c->holders); Py_INCREF(c->speculative);
    Py_INCREF(c->stored_type); Py_INCREF(c->removed_type); Py_INCREF(c->cleared_type);
    c->one = PyFloat_FromDouble(1.0);
    c->offload_weight = PyFloat_FromDouble(weight);
    c->storage_medium = PyUnicode_InternFromString("STORAGE");
    c->device_medium = PyUnicode_InternFromString("GPU");
    c->free_head = c->lru_head = c->lru_tail = NONE_ID;
    if (!c->one || !c->offload_weight || !c->storage_medium || !c->device_medium) return -1;
    if (map_init(&c->blocks, 1024) < 0 || map_init(&c->entries_of, 1024) < 0) { PyErr_NoMemory(); return -1; }
    return 0;
}

static void Core_dealloc(Core *c) {
    for (int32_t i = 0; i < c->n_members; i++) Py_DECREF(c->names[i]);
    PyMem_Free(c->names);
    PyMem_Free(c->held);
    PyMem_Free(c->entries);
    PyMem_Free(c->blocks.slots);
    PyMem_Free(c->entries_of.slots);
    Py_XDECREF(c->holders); Py_XDECREF(c->speculative); Py_XDECREF(c->one); Py_XDECREF(c->offload_weight);
    Py_XDECREF(c->stored_type); Py_XDECREF(c->removed_type); Py_XDECREF(c->cleared_type);
    Py_XDECREF(c->storage_medium); Py_XDECREF(c->device_medium);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"apply", (PyCFunction)Core_apply, METH_VARARGS,
     "apply(events, member, guesses, store, store_guesses) -> (stored, removed, cleared, block size, store's)"},
    {"add_member", (PyCFunction)Core_add_member, METH_O, "add_member(name) -> member id"},
    {"forget_member", (PyCFunction)Core_forget_member, METH_O, "forget every entry of a member id"},
    {"held", (PyCFunction)Core_held, METH_O, "held(member id) -> its entries"},
    {"lru_items", (PyCFunction)Core_lru_items, METH_NOARGS, "[(member, engine key)], oldest first"},
    {"counters", (PyCFunction)Core_counters, METH_NOARGS, "(entries, orphans, evicted)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdserve_kv_index.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The prefix index's entries, applied from KV events in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdserve_kv_index", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_pdserve_kv_index(void) {
    s_block_hashes = PyUnicode_InternFromString("block_hashes");
    s_parent = PyUnicode_InternFromString("parent_block_hash");
    s_token_ids = PyUnicode_InternFromString("token_ids");
    s_block_size = PyUnicode_InternFromString("block_size");
    s_medium = PyUnicode_InternFromString("medium");
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
