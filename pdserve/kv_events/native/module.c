/* The prefix index's C core as a Python type: members, counters, construction (the events are core.c's). */

#include "core.h"

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

static PyMethodDef module_methods[] = {
    {"content_keys", content_keys, METH_VARARGS,
     "content_keys(tokens, start, block_size, count, seed) -> the chained keys of `count` blocks from `start`"},
    {"known_run", known_run, METH_VARARGS, "known_run(keys, start, holders, guesses) -> keys known from start on"},
    {"overlap", overlap, METH_VARARGS,
     "overlap(keys, holders, guesses, members, store_of, now) -> {member: credited blocks from the start}"},
    {"credit", credit, METH_VARARGS,
     "credit(keys, holders, guesses, member, expiry, member_guesses, block_size) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdserve_kv_index", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit_pdserve_kv_index(void) {
    if (core_init_names() < 0 || PyType_Ready(&CoreType) < 0) return NULL;
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
