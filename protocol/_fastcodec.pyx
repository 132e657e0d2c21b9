# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The compiled fast paths of `protocol.codec`: they handle the common well-formed case and decline the rest.

    decode_fast(frames, max_frame_bytes) -> the Message that codec's Python decoder returns, or None
    encode_fast(msg) -> the frames that codec's Python encoder returns, or None

None means "not the common case": any surprise gives None, and codec then runs its Python code on the
same input. For decode that is a frame type other than bytes or zmq.Frame, a wrong type, size, dtype or
version, bad MessagePack, a value the checks refuse, an int sent for a float. For encode it is an
array that is not a C-contiguous 1-D numpy array of the exact dtype. The Python code names what is
wrong (or handles the rare legal case), so nothing here explains or raises an error, and the contract
stays small: whatever this returns is exactly what the Python code returns. tests/test_fastcodec.py
holds it to that by fuzzing both on the same inputs.

Why it exists: decode runs once per rollout group on the hub's one thread, between the event loop's
receive calls, and those evict the interpreter's code and data from the cache. In that loop the Python
decoder cost 17.5 us per 8x64-token group against 38 us for the receive itself. Here it costs 2.4 us
under timeit against 8.9 (bench/channel.py has the end-to-end figures).

The per-type plans come from codec's schemas (`codec._Schema`), so the wire layout is defined once.
"""

from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy

cimport numpy as cnp

cnp.import_array()

cdef extern from *:
    const char* FASTCODEC_SOURCE_SHA  # setup.py defines it: the sha256 of this file, so codec can refuse a stale build

SOURCE_SHA = FASTCODEC_SOURCE_SHA.decode("ascii")

cdef extern from "numpy/arrayobject.h":
    # np.frombuffer's own implementation: a buffer that must be released is wrapped in a memoryview,
    # as np.frombuffer does. It steals a reference to the dtype.
    object PyArray_FromBuffer(object buf, cnp.dtype dtype, cnp.npy_intp count, cnp.npy_intp offset)

# The bits of 1e30 as a float32. The Python check sums the float32 logprobs and calls the sum
# non-finite if it overflows. Fewer than MAX_LOGPROBS values below 1e30 cannot make it overflow (they sum
# under 2.7e38; float32's max is 3.4e38), so the fast path takes only those, and leaves larger values and
# longer groups (over 1 GB of logprobs: the default frame limit is 64 MB) to the Python check.
cdef int32_t LOGPROB_LIMIT_BITS = 0x7149F2CA
cdef Py_ssize_t MAX_LOGPROBS = 1 << 28
cdef int32_t INF_BITS = 0x7F800000


cdef class Plan:
    """One message type's layout, from codec._Schema, in the form the fast paths read."""
    cdef object cls
    cdef str name
    cdef tuple types  # exact types of the header values: the fields, then the array dims
    cdef Py_ssize_t nfields
    cdef str dtypes_wire
    cdef tuple dtypes  # numpy dtype per array frame (little endian: this is only built on little-endian hosts)
    cdef tuple fields
    cdef tuple arrays
    cdef tuple str_lists  # indices of the list[str] fields
    cdef bint rollout  # RolloutGroup: its check() runs here, compiled
    cdef object check  # the other types' check(), called as Python

    def __init__(self, cls, name, types, fields, arrays, dtypes_wire, dtypes, str_lists, rollout):
        self.cls, self.name, self.types, self.nfields = cls, name, tuple(types), len(fields)
        self.fields, self.arrays, self.dtypes_wire, self.dtypes = tuple(fields), tuple(arrays), dtypes_wire, tuple(dtypes)
        self.str_lists, self.rollout, self.check = tuple(str_lists), rollout, cls.check


cdef dict _by_name = {}
cdef dict _by_class = {}
cdef object _unpackb = None, _packb = None
cdef object _version = None
cdef tuple _frame_types = ()
cdef object _new = object.__new__


def setup(plans, packb, unpackb, int version, frame_types):
    """Called once by protocol.codec at import: the plans, msgpack's packb and unpackb, PROTOCOL_VERSION,
    and the frame types whose len() is their size in bytes."""
    global _by_name, _by_class, _packb, _unpackb, _version, _frame_types
    _by_name = {(<Plan>p).name: p for p in plans}
    _by_class = {(<Plan>p).cls: p for p in plans}
    _packb, _unpackb, _version, _frame_types = packb, unpackb, version, tuple(frame_types)


def encode_fast(msg):
    plan_obj = _by_class.get(type(msg))
    if plan_obj is None:
        return None
    cdef Plan plan = <Plan>plan_obj
    cdef Py_ssize_t i, narrays = len(plan.arrays)
    cdef list values = [getattr(msg, name) for name in plan.fields]
    cdef list frames = [None]
    cdef cnp.ndarray arr
    for i in range(narrays):
        a = getattr(msg, plan.arrays[i])
        if type(a) is not cnp.ndarray:
            return None
        arr = <cnp.ndarray>a
        if not cnp.PyArray_EquivTypes(arr.dtype, <cnp.dtype>plan.dtypes[i]):  # dtype ==, byte order included
            return None
        if cnp.PyArray_NDIM(arr) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            return None
        values.append(cnp.PyArray_DIM(arr, 0))
        frames.append(arr)
    frames[0] = _packb((_version, plan.name, plan.dtypes_wire, values))
    return frames


cdef bint _all_str(object v):
    if type(v) is not list:
        return False
    for x in <list>v:
        if type(x) is not str:
            return False
    return True


cdef inline int32_t _load(const char* p, Py_ssize_t i) noexcept nogil:
    """The i-th 4-byte value at p, aligned or not. Frames received over TCP start at any offset in libzmq's
    receive buffer, and reading them through an int32_t* would be undefined; a 4-byte memcpy compiles to
    one unaligned load (movdqu when vectorised)."""
    cdef int32_t v
    memcpy(&v, p + 4 * i, 4)
    return v


cdef bint _floats_below(cnp.ndarray a, int32_t limit_bits):
    """Every float32 value finite, with a magnitude below the float whose bits are limit_bits."""
    cdef const char* p = <const char*>cnp.PyArray_DATA(a)
    cdef Py_ssize_t i, n = cnp.PyArray_SIZE(a)
    cdef int32_t over = 0
    for i in range(n):  # the magnitude bits order as the floats do; an OR of compares, vectorised with plain SSE2
        over |= (_load(p, i) & 0x7FFFFFFF) >= limit_bits
    return not over


cdef bint _rollout_ok(object msg, list arrays):
    """RolloutGroup.check, compiled: True where it would pass (see LOGPROB_LIMIT_BITS)."""
    cdef cnp.ndarray lengths = arrays[1], tokens = arrays[2], logprobs = arrays[3], rewards = arrays[4], parts = arrays[5]
    cdef const char* lp = <const char*>cnp.PyArray_DATA(lengths)
    cdef Py_ssize_t i, n = cnp.PyArray_SIZE(lengths)
    cdef int64_t total = 0
    cdef int32_t smallest = 0, length
    if n == 0:
        return False
    for i in range(n):
        length = _load(lp, i)
        smallest = min(smallest, length)
        total += length
    if smallest < 0 or cnp.PyArray_SIZE(tokens) != total or cnp.PyArray_SIZE(logprobs) != total or total > MAX_LOGPROBS:
        return False
    if cnp.PyArray_SIZE(rewards) != n or len(msg.finish_reasons) != n or msg.version_max < msg.version_min:
        return False
    if cnp.PyArray_SIZE(parts) != n * len(msg.reward_part_names) or not 0 <= msg.reward_errors <= n:
        return False
    return (_floats_below(rewards, INF_BITS) and _floats_below(logprobs, LOGPROB_LIMIT_BITS)
            and _floats_below(parts, INF_BITS))


def decode_fast(frames, max_frame_bytes):
    if type(frames) is not list or type(max_frame_bytes) is not int or not 0 <= max_frame_bytes <= PY_SSIZE_T_MAX:
        return None
    cdef Py_ssize_t limit = max_frame_bytes
    cdef list fl = <list>frames
    cdef Py_ssize_t nframes = len(fl), i
    if nframes == 0:
        return None
    for f in fl:
        if type(f) not in _frame_types or len(f) > limit:
            return None
    try:
        header = _unpackb(fl[0])
    except Exception:
        return None
    if type(header) is not list or len(<list>header) != 4:
        return None
    version, name, dtypes, values = <list>header
    if type(version) is not int or version != _version or type(name) is not str or type(values) is not list:
        return None
    plan_obj = _by_name.get(name)
    if plan_obj is None:
        return None
    cdef Plan plan = <Plan>plan_obj
    cdef list vals = <list>values
    cdef tuple types = plan.types
    if len(vals) != len(types) or nframes != 1 + len(plan.arrays) or dtypes != plan.dtypes_wire:
        return None
    for i in range(len(types)):
        if type(vals[i]) is not types[i]:
            return None
    for i in plan.str_lists:
        if not _all_str(vals[i]):
            return None
    cdef list arrays = []
    cdef cnp.ndarray arr
    for i in range(1, nframes):
        dtype = plan.dtypes[i - 1]
        Py_INCREF(dtype)  # stolen by PyArray_FromBuffer
        try:
            arr = PyArray_FromBuffer(fl[i], <cnp.dtype>dtype, -1, 0)
        except (TypeError, ValueError):  # not a whole number of elements (numpy's own check)
            return None
        if cnp.PyArray_DIM(arr, 0) != vals[plan.nfields + i - 1]:  # compared as Python ints: any value is safe
            return None
        arrays.append(arr)
    msg = _new(plan.cls)
    for i in range(plan.nfields):
        setattr(msg, plan.fields[i], vals[i])
    for i in range(nframes - 1):
        setattr(msg, plan.arrays[i], arrays[i])
    if plan.rollout:
        return msg if _rollout_ok(msg, arrays) else None
    try:
        plan.check(msg)
    except Exception:
        return None
    return msg
