/* What routing asks of the index, in C: the chained content keys of a prompt's blocks (as the Python index computes
   them, `content_keys`), how far they are known, each candidate's credited run, and the credit of the chosen one. Once
   events were applied in C, these were most of a pick left in the interpreter; the Python versions
   (pdserve/kv_events/index_queries.py) are the fallback, and tests/test_kv_index_native.py holds the two alike. */

#include "core.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#define STACK_IDS 512 /* a block of up to this many tokens is converted on the stack */

/* The ids of one block as uint32, the bytes the Python side hashes (an array("I")). */
static int block_ids(PyObject *tokens, Py_ssize_t start, Py_ssize_t bs, uint32_t *out) {
    for (Py_ssize_t i = 0; i < bs; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(tokens, start + i));
        if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
        if (v > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "a token id does not fit in 32 bits");
            return -1;
        }
        out[i] = (uint32_t)v;
    }
    return 0;
}

/* content_keys(tokens: list[int], start, block_size, count, seed) -> list[int]: the keys of the `count` whole
   blocks from token `start` on (fewer where the list ends first), each the XXH3-64 of its ids seeded with the key
   before it (`seed` for the first). */
PyObject *content_keys(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *tokens;
    Py_ssize_t start, bs, count;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "O!nnnK", &PyList_Type, &tokens, &start, &bs, &count, &seed)) return NULL;
    if (bs < 1 || bs > INT32_MAX / 4 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive and start not negative");
        return NULL;
    }
    Py_ssize_t whole = start < PyList_GET_SIZE(tokens) ? (PyList_GET_SIZE(tokens) - start) / bs : 0;
    if (count < 0 || count > whole) count = whole;
    uint32_t stack[STACK_IDS], *ids = bs <= STACK_IDS ? stack : PyMem_Malloc((size_t)bs * sizeof(uint32_t));
    if (!ids) return PyErr_NoMemory();
    PyObject *out = PyList_New(count);
    uint64_t key = seed;
    for (Py_ssize_t n = 0; out && n < count; n++) {
        PyObject *item = NULL;
        if (block_ids(tokens, start + n * bs, bs, ids) == 0) {
            key = XXH3_64bits_withSeed(ids, (size_t)bs * 4, key);
            item = PyLong_FromUnsignedLongLong(key);
        }
        if (!item) Py_CLEAR(out);
        else PyList_SET_ITEM(out, n, item);
    }
    if (ids != stack) PyMem_Free(ids);
    return out;
}

/* known_run(keys, start, holders, guesses) -> int: how many of keys[start:], from the first, are in either dict
   (block size's holders, and its credits). */
PyObject *known_run(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *keys, *holders, *guesses;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!nO!O!", &PyList_Type, &keys, &start, &PyDict_Type, &holders, &PyDict_Type,
                          &guesses))
        return NULL;
    Py_ssize_t n = start < 0 ? 0 : start, end = PyList_GET_SIZE(keys);
    for (; n < end; n++) {
        PyObject *key = PyList_GET_ITEM(keys, n);
        int found = PyDict_Contains(holders, key);
        if (found == 0) found = PyDict_Contains(guesses, key);
        if (found < 0) return NULL;
        if (!found) break;
    }
    return PyLong_FromSsize_t(n - (start < 0 ? 0 : start));
}

/* A member's credit for one block: its own copy's weight, or 1 for a credit not yet expired; where it reads a
   store, the store's copy when that is worth more. 0: none (the run ends), 1: found (*weight), -1: error. */
static int block_credit(PyObject *holders_k, PyObject *guesses, PyObject *key, PyObject *member, PyObject *store,
                        double now, double *weight) {
    int have = 0;
    PyObject *w = holders_k ? PyDict_GetItemWithError(holders_k, member) : NULL;
    if (w) {
        *weight = PyFloat_AsDouble(w);
        have = 1;
    } else {
        if (PyErr_Occurred()) return -1;
        PyObject *guesses_k = PyDict_GetItemWithError(guesses, key);
        PyObject *expiry = guesses_k ? PyDict_GetItemWithError(guesses_k, member) : NULL;
        if (PyErr_Occurred()) return -1;
        if (expiry && PyFloat_AsDouble(expiry) > now) {
            *weight = 1.0;
            have = 1;
        }
    }
    if (store != Py_None && holders_k && (!have || *weight < 1.0)) {
        PyObject *stored = PyDict_GetItemWithError(holders_k, store);
        if (stored) {
            double s = PyFloat_AsDouble(stored);
            if (!have || s > *weight) *weight = s;
            have = 1;
        } else if (PyErr_Occurred()) {
            return -1;
        }
    }
    return PyErr_Occurred() ? -1 : have;
}

/* overlap(keys, holders, guesses, members, store_of, now) -> {member: float}: for each member (and the store it
   reads, by `store_of`), its credited blocks over the longest run of keys from the start that it holds. */
PyObject *overlap(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *keys, *holders, *guesses, *members, *store_of;
    double now;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!d", &PyList_Type, &keys, &PyDict_Type, &holders, &PyDict_Type, &guesses,
                          &PyList_Type, &members, &PyDict_Type, &store_of, &now))
        return NULL;
    PyObject *out = PyDict_New();
    for (Py_ssize_t j = 0; out && j < PyList_GET_SIZE(members); j++) {
        PyObject *member = PyList_GET_ITEM(members, j), *store = PyDict_GetItemWithError(store_of, member);
        if (!store && PyErr_Occurred()) { Py_CLEAR(out); break; }
        double total = 0.0, weight = 0.0;
        for (Py_ssize_t n = 0; n < PyList_GET_SIZE(keys); n++) {
            PyObject *key = PyList_GET_ITEM(keys, n), *holders_k = PyDict_GetItemWithError(holders, key);
            int have = !holders_k && PyErr_Occurred() ? -1
                       : block_credit(holders_k, guesses, key, member, store ? store : Py_None, now, &weight);
            if (have < 0) { Py_CLEAR(out); break; }
            if (!have) break;
            total += weight;
        }
        PyObject *item = out ? PyFloat_FromDouble(total) : NULL;
        if (!item || PyDict_SetItem(out, member, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

/* credit(keys, holders, guesses, member, expiry, member_guesses, block_size) -> None: credit `member` with each
   block it does not hold in its device cache, until `expiry`, in the block size's credits and in its own record
   (keyed (block size, key)). */
PyObject *credit(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *keys, *holders, *guesses, *member, *expiry, *mine, *bs;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!O!O", &PyList_Type, &keys, &PyDict_Type, &holders, &PyDict_Type, &guesses,
                          &member, &PyFloat_Type, &expiry, &PyDict_Type, &mine, &bs))
        return NULL;
    for (Py_ssize_t n = 0; n < PyList_GET_SIZE(keys); n++) {
        PyObject *key = PyList_GET_ITEM(keys, n), *holders_k = PyDict_GetItemWithError(holders, key);
        PyObject *w = holders_k ? PyDict_GetItemWithError(holders_k, member) : NULL;
        if (PyErr_Occurred()) return NULL;
        if (w) {
            double held = PyFloat_AsDouble(w);
            if (held == -1.0 && PyErr_Occurred()) return NULL;
            if (held == 1.0) continue;  /* a device copy: its engine publishes nothing to confirm a credit */
        }
        PyObject *by_member = PyDict_GetItemWithError(guesses, key);
        if (!by_member) {
            if (PyErr_Occurred() || !(by_member = PyDict_New())) return NULL;
            int added = PyDict_SetItem(guesses, key, by_member);
            Py_DECREF(by_member);  /* the dict holds it */
            if (added < 0) return NULL;
        }
        PyObject *named = PyTuple_Pack(2, bs, key);
        int failed = !named || PyDict_SetItem(by_member, member, expiry) < 0 || PyDict_SetItem(mine, named, expiry) < 0;
        Py_XDECREF(named);
        if (failed) return NULL;
    }
    Py_RETURN_NONE;
}
