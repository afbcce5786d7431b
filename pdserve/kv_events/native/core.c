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

#include "core.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#define ROOT_KEY 1337ULL /* the chain's seed, as the Python core's */

static PyObject *s_block_hashes, *s_parent, *s_token_ids, *s_block_size, *s_medium;

int core_init_names(void) {
    s_block_hashes = PyUnicode_InternFromString("block_hashes");
    s_parent = PyUnicode_InternFromString("parent_block_hash");
    s_token_ids = PyUnicode_InternFromString("token_ids");
    s_block_size = PyUnicode_InternFromString("block_size");
    s_medium = PyUnicode_InternFromString("medium");
    return s_block_hashes && s_parent && s_token_ids && s_block_size && s_medium ? 0 : -1;
}

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

int forget_member(Core *c, int32_t member) {
    for (int32_t id = c->lru_head; id != NONE_ID;) {
        int32_t next = c->entries[id].next;
        if (c->entries[id].member == member && forget(c, id) < 0) return -1;
        id = next;
    }
    return 0;
}

/* -- applying a batch ------------------------------------------------------------------------------------------ */
int check_member(Core *c, int member) {
    if (member < 0 || member >= c->n_members) {
        PyErr_Format(PyExc_IndexError, "no member %d", member);
        return -1;
    }
    return 0;
}

PyObject *Core_apply(Core *c, PyObject *args) {
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
        int to_store = store != NONE_ID && medium != Py_None ?
                       PyObject_RichCompareBool(medium, c->storage_medium, Py_EQ) : 0;
        int device = to_store < 0 ? -1 : is_device(c, medium);
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
