/*
 * ingest._otlp_fast: the OTLP/protobuf fast path of ingest (see ingest/otlp.py, decode_protobuf_fast).
 *
 * Python's decoder (ingest.otlp.decode_protobuf) is the reference and stays the only decoder
 * for anything unusual. This module takes the common case, a well-formed request whose every
 * span is valid, and does the per-span work that held the GIL in Python:
 *
 *   parse()      reads the wire format and checks every span (GIL released);
 *   views()      builds the SpanView objects the normalisers read (GIL held, no Python code but
 *                the dataclass constructors);
 *   span_rows()  writes the spans' JSONCompactEachRow rows (GIL released), byte for byte what
 *                ingest.rows.span_row + encode_rows write for the same spans.
 *
 * parse() returns None, and the caller decodes with Python, as soon as the payload leaves the
 * subset this file handles exactly:
 *   - anything malformed, an unknown field number, a field with an unexpected wire type, a
 *     singular sub-message (resource, scope, status, key/value) given twice (protobuf merges);
 *   - any span Python would reject (ids, times) or trim (limits), any invalid UTF-8;
 *   - attribute values other than string, bool, int, double, unset, or a list of those
 *     (bytes, key/value lists and nested lists go to Python);
 *   - an empty, over-long or repeated attribute key.
 * Scope and link attributes are never read, only checked as protobuf would check them.
 * tests/ingest/test_otlp_fast.py holds this file to the Python decoder.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_KEY_BYTES 256
#define MAX_NAME_BYTES 1024
#define MAX_DEPTH 64

/* ---------------------------------------------------------------------------------------------- */
/* growable arrays (malloc, no GIL needed) */

typedef struct {
    const char *p;
    Py_ssize_t n;
} Str;

static inline int is_finite(double d) {
    return d - d == 0.0;
}

enum { V_NONE = 0, V_STR, V_INT, V_DOUBLE, V_BOOL, V_ARRAY };

typedef struct {
    Str key;
    int type;
    Str s;           /* V_STR */
    int64_t i;       /* V_INT, V_BOOL */
    double d;        /* V_DOUBLE */
    uint32_t first;  /* V_ARRAY: first element in Batch.elems */
    uint32_t count;  /* V_ARRAY: elements kept (at most max_attributes) */
    uint32_t text;   /* V_DOUBLE: its JSON text in the orjson output of span_rows (double_texts) */
    uint32_t text_n;
} Attr;

typedef struct {
    uint64_t time;
    Str name;
    uint32_t attr_first, attr_count;
} EventRec;

typedef struct {
    Str trace_id, span_id;
} LinkRec;

typedef struct {
    const uint8_t *trace_id, *span_id, *parent;  /* parent NULL: a root span */
    Str name;
    int32_t kind, status_code;
    uint64_t start, end;
    Str status_message;
    uint32_t attr_first, attr_count;
    uint32_t event_first, event_count;
    uint32_t link_first, link_count;
    uint32_t dropped;
    uint32_t resource, scope;
} SpanRec;

typedef struct {
    uint32_t attr_first, attr_count;
    int seen;
} ResourceRec;

typedef struct {
    Str name, version;
    int seen;
} ScopeRec;

#define DEFINE_VEC(T, NAME)                                                              \
    typedef struct {                                                                     \
        T *items;                                                                        \
        uint32_t n, cap;                                                                 \
    } NAME;                                                                              \
    static T *NAME##_push(NAME *v) {                                                     \
        if (v->n == v->cap) {                                                            \
            uint32_t cap = v->cap ? v->cap * 2 : 64;                                     \
            T *items = PyMem_RawRealloc(v->items, (size_t)cap * sizeof(T));              \
            if (!items) return NULL;                                                     \
            v->items = items;                                                            \
            v->cap = cap;                                                                \
        }                                                                                \
        T *item = &v->items[v->n++];                                                     \
        memset(item, 0, sizeof(T));                                                      \
        return item;                                                                     \
    }

DEFINE_VEC(Attr, AttrVec)
DEFINE_VEC(EventRec, EventVec)
DEFINE_VEC(LinkRec, LinkVec)
DEFINE_VEC(SpanRec, SpanVec)
DEFINE_VEC(ResourceRec, ResourceVec)
DEFINE_VEC(ScopeRec, ScopeVec)

typedef struct {
    char *p;
    size_t n, cap;
    int failed;
} Buf;

static int buf_reserve(Buf *b, size_t extra) {
    if (b->n + extra <= b->cap) return 1;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + extra) cap *= 2;
    char *p = PyMem_RawRealloc(b->p, cap);
    if (!p) {
        b->failed = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

static inline void buf_put(Buf *b, const char *s, size_t n) {
    if (!buf_reserve(b, n)) return;
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static inline void buf_ch(Buf *b, char c) {
    if (!buf_reserve(b, 1)) return;
    b->p[b->n++] = c;
}

/* ---------------------------------------------------------------------------------------------- */
/* the batch object */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    AttrVec attrs, elems;
    EventVec events;
    LinkVec links;
    SpanVec spans;
    ResourceVec resources;
    ScopeVec scopes;
    /* limits */
    uint32_t max_attributes, max_events;
    uint64_t max_value_bytes;
} Batch;

static void Batch_dealloc(Batch *self) {
    if (self->has_view) PyBuffer_Release(&self->view);
    PyMem_RawFree(self->attrs.items);
    PyMem_RawFree(self->elems.items);
    PyMem_RawFree(self->events.items);
    PyMem_RawFree(self->links.items);
    PyMem_RawFree(self->spans.items);
    PyMem_RawFree(self->resources.items);
    PyMem_RawFree(self->scopes.items);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---------------------------------------------------------------------------------------------- */
/* wire format */

typedef struct {
    uint32_t num;
    int wt;
    uint64_t v;         /* wire types 0, 1, 5 */
    const uint8_t *p;   /* wire type 2 */
    size_t n;
} Field;

static inline int read_varint(const uint8_t **pp, const uint8_t *end, uint64_t *out) {
    const uint8_t *p = *pp;
    uint64_t v = 0;
    for (int shift = 0; shift < 70 && p < end; shift += 7) {
        uint8_t b = *p++;
        if (shift == 63 && b > 1) return 0; /* beyond 64 bits: let the reference decide */
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *pp = p;
            *out = v;
            return 1;
        }
    }
    return 0;
}

/* The next field of a message; 0 at a malformed one (the caller bails). */
static inline int next_field(const uint8_t **pp, const uint8_t *end, Field *f) {
    uint64_t tag;
    if (!read_varint(pp, end, &tag) || tag > 0xFFFFFFFFu) return 0;
    f->num = (uint32_t)(tag >> 3);
    f->wt = (int)(tag & 7);
    if (f->num == 0) return 0;
    const uint8_t *p = *pp;
    switch (f->wt) {
    case 0:
        return read_varint(pp, end, &f->v);
    case 1:
        if (end - p < 8) return 0;
        memcpy(&f->v, p, 8); /* little-endian hosts only (checked at import) */
        *pp = p + 8;
        return 1;
    case 2: {
        uint64_t n;
        if (!read_varint(pp, end, &n)) return 0;
        p = *pp;
        if (n > (uint64_t)(end - p)) return 0;
        f->p = p;
        f->n = (size_t)n;
        *pp = p + n;
        return 1;
    }
    case 5: {
        uint32_t v32;
        if (end - p < 4) return 0;
        memcpy(&v32, p, 4);
        f->v = v32;
        *pp = p + 4;
        return 1;
    }
    default:
        return 0; /* groups and reserved wire types */
    }
}

/* Strict UTF-8 (no surrogates, no overlong forms, nothing past U+10FFFF), as upb and Python check it. */
static int utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) {
                i += 8;
                continue;
            }
        }
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n) return 0;
            uint8_t c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && c1 < 0xA0) return 0; /* overlong */
            if (c == 0xED && c1 > 0x9F) return 0; /* surrogate */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n) return 0;
            uint8_t c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80) return 0;
            if (c == 0xF0 && c1 < 0x90) return 0; /* overlong */
            if (c == 0xF4 && c1 > 0x8F) return 0; /* past U+10FFFF */
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

#define STR_OF(f) ((Str){(const char *)(f).p, (Py_ssize_t)(f).n})

/* -- checked but not kept: scope and link attributes (any AnyValue protobuf accepts) -- */

static int check_key_value(const uint8_t *p, const uint8_t *end, int depth);

static int check_any_value(const uint8_t *p, const uint8_t *end, int depth) {
    Field f;
    if (depth > MAX_DEPTH) return 0;
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        switch (f.num) {
        case 1: /* string_value */
            if (f.wt != 2 || !utf8_ok(f.p, f.n)) return 0;
            break;
        case 2: case 3: /* bool_value, int_value */
            if (f.wt != 0) return 0;
            break;
        case 4: /* double_value */
            if (f.wt != 1) return 0;
            break;
        case 7: /* bytes_value */
            if (f.wt != 2) return 0;
            break;
        case 5: case 6: { /* array_value, kvlist_value: repeated field 1 */
            if (f.wt != 2) return 0;
            const uint8_t *q = f.p, *qend = f.p + f.n;
            Field g;
            while (q < qend) {
                if (!next_field(&q, qend, &g) || g.num != 1 || g.wt != 2) return 0;
                if (!(f.num == 5 ? check_any_value(g.p, g.p + g.n, depth + 1)
                                 : check_key_value(g.p, g.p + g.n, depth + 1)))
                    return 0;
            }
            break;
        }
        default:
            return 0;
        }
    }
    return 1;
}

static int check_key_value(const uint8_t *p, const uint8_t *end, int depth) {
    Field f;
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        if (f.num == 1) {
            if (f.wt != 2 || !utf8_ok(f.p, f.n)) return 0;
        } else if (f.num == 2) {
            if (f.wt != 2 || !check_any_value(f.p, f.p + f.n, depth + 1)) return 0;
        } else {
            return 0;
        }
    }
    return 1;
}

/* -- kept: span, event and resource attributes -- */

static inline int string_fits(const Batch *b, size_t n) {
    /* Python trims a value only when it is over 1024 characters and over max_value_bytes bytes. */
    return n <= MAX_NAME_BYTES || n <= b->max_value_bytes;
}

/* One scalar AnyValue into `a` (type/value); arrays allowed only when `array_ok`. */
static int parse_any_value(Batch *b, const uint8_t *p, const uint8_t *end, Attr *a, int array_ok) {
    Field f;
    a->type = V_NONE;
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        switch (f.num) {
        case 1:
            if (f.wt != 2 || !string_fits(b, f.n) || !utf8_ok(f.p, f.n)) return 0;
            a->type = V_STR;
            a->s = STR_OF(f);
            break;
        case 2:
            if (f.wt != 0) return 0;
            a->type = V_BOOL;
            a->i = f.v != 0;
            break;
        case 3:
            if (f.wt != 0) return 0;
            a->type = V_INT;
            a->i = (int64_t)f.v;
            break;
        case 4: {
            if (f.wt != 1) return 0;
            a->type = V_DOUBLE;
            memcpy(&a->d, &f.v, 8);
            break;
        }
        case 5: {
            if (f.wt != 2 || !array_ok || a->type == V_ARRAY) return 0; /* a second array would merge */
            const uint8_t *q = f.p, *qend = f.p + f.n;
            Field g;
            uint32_t first = b->elems.n, kept = 0;
            while (q < qend) {
                if (!next_field(&q, qend, &g) || g.num != 1 || g.wt != 2) return 0;
                if (kept < b->max_attributes) {
                    /* elems may move while it grows: fill a local, then store it */
                    Attr e;
                    memset(&e, 0, sizeof e);
                    if (!parse_any_value(b, g.p, g.p + g.n, &e, 0)) return 0;
                    Attr *slot = AttrVec_push(&b->elems);
                    if (!slot) return 0;
                    *slot = e;
                    kept++;
                } else if (!check_any_value(g.p, g.p + g.n, 1)) {
                    return 0; /* cut by Python, but still parsed (checked) by protobuf */
                }
            }
            a->type = V_ARRAY;
            a->first = first;
            a->count = kept;
            break;
        }
        default: /* kvlist_value, bytes_value, string_value_strindex, unknown: Python decides */
            return 0;
        }
    }
    return 1;
}

static int parse_key_value(Batch *b, const uint8_t *p, const uint8_t *end) {
    Field f;
    Attr a;
    int has_value = 0, has_key = 0;
    memset(&a, 0, sizeof a);
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        if (f.num == 1) {
            if (f.wt != 2) return 0;
            a.key = STR_OF(f);
            has_key = 1;
        } else if (f.num == 2) {
            if (f.wt != 2 || has_value) return 0; /* a second value would merge into the first */
            if (!parse_any_value(b, f.p, f.p + f.n, &a, 1)) return 0;
            has_value = 1;
        } else {
            return 0;
        }
    }
    if (!has_key || a.key.n == 0 || a.key.n > MAX_KEY_BYTES || !utf8_ok((const uint8_t *)a.key.p, a.key.n))
        return 0;
    Attr *slot = AttrVec_push(&b->attrs);
    if (!slot) return 0;
    *slot = a;
    return 1;
}

/* Repeated keys in one list: Python keeps the first position and the last value; leave that to it. */
static int keys_unique(const Batch *b, uint32_t first, uint32_t count) {
    const Attr *a = b->attrs.items + first;
    for (uint32_t i = 1; i < count; i++)
        for (uint32_t j = 0; j < i; j++)
            if (a[i].key.n == a[j].key.n && memcmp(a[i].key.p, a[j].key.p, a[i].key.n) == 0) return 0;
    return 1;
}

/* Close an attribute list started at `first`: count and uniqueness. */
static int finish_attrs(const Batch *b, uint32_t first, uint32_t *count_out) {
    uint32_t count = b->attrs.n - first;
    if (count > b->max_attributes) return 0;
    if (count > 1 && !keys_unique(b, first, count)) return 0;
    *count_out = count;
    return 1;
}

typedef struct {
    uint64_t earliest, latest, max_duration;
} Window;

static int parse_event(Batch *b, const uint8_t *p, const uint8_t *end) {
    Field f;
    EventRec e;
    memset(&e, 0, sizeof e);
    e.attr_first = b->attrs.n;
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        switch (f.num) {
        case 1:
            if (f.wt != 1) return 0;
            e.time = f.v;
            break;
        case 2:
            if (f.wt != 2) return 0;
            e.name = STR_OF(f);
            break;
        case 3:
            if (f.wt != 2 || !parse_key_value(b, f.p, f.p + f.n)) return 0;
            break;
        case 4:
            if (f.wt != 0) return 0;
            break;
        default:
            return 0;
        }
    }
    if ((uint64_t)e.name.n > b->max_value_bytes || !utf8_ok((const uint8_t *)e.name.p, e.name.n)) return 0;
    if (!finish_attrs(b, e.attr_first, &e.attr_count)) return 0;
    EventRec *slot = EventVec_push(&b->events);
    if (!slot) return 0;
    *slot = e;
    return 1;
}

static int parse_link(Batch *b, const uint8_t *p, const uint8_t *end) {
    Field f;
    LinkRec l;
    memset(&l, 0, sizeof l);
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        switch (f.num) {
        case 1:
            if (f.wt != 2) return 0;
            l.trace_id = STR_OF(f);
            break;
        case 2:
            if (f.wt != 2) return 0;
            l.span_id = STR_OF(f);
            break;
        case 3:
            if (f.wt != 2 || !utf8_ok(f.p, f.n)) return 0;
            break;
        case 4:
            if (f.wt != 2 || !check_key_value(f.p, f.p + f.n, 0)) return 0;
            break;
        case 5:
            if (f.wt != 0) return 0;
            break;
        case 6:
            if (f.wt != 5) return 0;
            break;
        default:
            return 0;
        }
    }
    LinkRec *slot = LinkVec_push(&b->links);
    if (!slot) return 0;
    *slot = l;
    return 1;
}

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static int parse_span(Batch *b, const uint8_t *p, const uint8_t *end, const Window *w, uint32_t resource,
                      uint32_t scope) {
    Field f;
    SpanRec s;
    Field trace = {0}, span = {0}, parent = {0};
    int has_status = 0;
    uint32_t n_events = 0;
    memset(&s, 0, sizeof s);
    s.attr_first = b->attrs.n;
    s.link_first = b->links.n;
    const uint8_t *start = p;
    /* Pass 1: everything but the events, so the span's attributes stay contiguous. */
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        switch (f.num) {
        case 1:
            if (f.wt != 2) return 0;
            trace = f;
            break;
        case 2:
            if (f.wt != 2) return 0;
            span = f;
            break;
        case 3: /* trace_state */
            if (f.wt != 2 || !utf8_ok(f.p, f.n)) return 0;
            break;
        case 4:
            if (f.wt != 2) return 0;
            parent = f;
            break;
        case 5:
            if (f.wt != 2) return 0;
            s.name = STR_OF(f);
            break;
        case 6:
            if (f.wt != 0) return 0;
            s.kind = (int32_t)f.v;
            break;
        case 7:
            if (f.wt != 1) return 0;
            s.start = f.v;
            break;
        case 8:
            if (f.wt != 1) return 0;
            s.end = f.v;
            break;
        case 9:
            if (f.wt != 2 || !parse_key_value(b, f.p, f.p + f.n)) return 0;
            break;
        case 10:
            if (f.wt != 0) return 0;
            s.dropped = (uint32_t)f.v;
            break;
        case 11:
            if (f.wt != 2) return 0;
            n_events++;
            break;
        case 12: case 14:
            if (f.wt != 0) return 0;
            break;
        case 13:
            if (f.wt != 2 || !parse_link(b, f.p, f.p + f.n)) return 0;
            break;
        case 15: {
            if (f.wt != 2 || has_status) return 0;
            has_status = 1;
            const uint8_t *q = f.p, *qend = f.p + f.n;
            Field g;
            while (q < qend) {
                if (!next_field(&q, qend, &g)) return 0;
                if (g.num == 2 && g.wt == 2) {
                    s.status_message = STR_OF(g);
                } else if (g.num == 3 && g.wt == 0) {
                    s.status_code = (int32_t)g.v;
                } else {
                    return 0;
                }
            }
            break;
        }
        case 16:
            if (f.wt != 5) return 0;
            break;
        default:
            return 0;
        }
    }
    if (!finish_attrs(b, s.attr_first, &s.attr_count)) return 0;
    s.link_count = b->links.n - s.link_first;
    if (s.link_count > b->max_events || n_events > b->max_events) return 0;
    /* ids and times: anything Python would reject goes to Python */
    if (trace.n != 16 || span.n != 8 || (parent.n != 0 && parent.n != 8)) return 0;
    if (all_zero(trace.p, 16) || all_zero(span.p, 8)) return 0;
    if (!(w->earliest <= s.start && s.start <= w->latest && s.start <= s.end && s.end - s.start <= w->max_duration))
        return 0;
    if (s.name.n > MAX_NAME_BYTES || !utf8_ok((const uint8_t *)s.name.p, s.name.n)) return 0;
    if ((uint64_t)s.status_message.n > b->max_value_bytes ||
        !utf8_ok((const uint8_t *)s.status_message.p, s.status_message.n))
        return 0;
    s.trace_id = trace.p;
    s.span_id = span.p;
    s.parent = parent.n ? parent.p : NULL;
    s.kind = (s.kind >= 0 && s.kind <= 5) ? s.kind : 0;
    s.status_code = (s.status_code >= 0 && s.status_code <= 2) ? s.status_code : 0;
    /* Pass 2: the events. */
    s.event_first = b->events.n;
    if (n_events) {
        p = start;
        while (p < end) {
            next_field(&p, end, &f); /* pass 1 read every field already */
            if (f.num == 11 && !parse_event(b, f.p, f.p + f.n)) return 0;
        }
    }
    s.event_count = b->events.n - s.event_first;
    s.resource = resource;
    s.scope = scope;
    SpanRec *slot = SpanVec_push(&b->spans);
    if (!slot) return 0;
    *slot = s;
    return 1;
}

static int parse_scope_spans(Batch *b, const uint8_t *p, const uint8_t *end, const Window *w, uint32_t resource) {
    Field f;
    uint32_t scope = b->scopes.n;
    if (!ScopeVec_push(&b->scopes)) return 0;
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        if (f.num == 1) {
            ScopeRec *sc = &b->scopes.items[scope];
            if (f.wt != 2 || sc->seen) return 0;
            sc->seen = 1;
            const uint8_t *q = f.p, *qend = f.p + f.n;
            Field g;
            while (q < qend) {
                if (!next_field(&q, qend, &g)) return 0;
                if (g.num == 1 && g.wt == 2) {
                    if (!utf8_ok(g.p, g.n)) return 0;
                    sc->name = STR_OF(g);
                } else if (g.num == 2 && g.wt == 2) {
                    if (!utf8_ok(g.p, g.n)) return 0;
                    sc->version = STR_OF(g);
                } else if (g.num == 3 && g.wt == 2) {
                    if (!check_key_value(g.p, g.p + g.n, 0)) return 0;
                } else if (!(g.num == 4 && g.wt == 0)) {
                    return 0;
                }
            }
        } else if (f.num == 2) {
            if (f.wt != 2 || !parse_span(b, f.p, f.p + f.n, w, resource, scope)) return 0;
        } else if (f.num == 3) {
            if (f.wt != 2 || !utf8_ok(f.p, f.n)) return 0;
        } else {
            return 0;
        }
    }
    return 1;
}

static int parse_resource_spans(Batch *b, const uint8_t *p, const uint8_t *end, const Window *w) {
    Field f;
    uint32_t resource = b->resources.n;
    if (!ResourceVec_push(&b->resources)) return 0;
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        if (f.num == 1) {
            if (f.wt != 2 || b->resources.items[resource].seen) return 0;
            b->resources.items[resource].seen = 1;
            uint32_t first = b->attrs.n, count;
            const uint8_t *q = f.p, *qend = f.p + f.n;
            Field g;
            while (q < qend) {
                if (!next_field(&q, qend, &g)) return 0;
                if (g.num == 1 && g.wt == 2) {
                    if (!parse_key_value(b, g.p, g.p + g.n)) return 0;
                } else if (!(g.num == 2 && g.wt == 0)) {
                    return 0; /* entity_refs and anything newer: Python */
                }
            }
            if (!finish_attrs(b, first, &count)) return 0;
            b->resources.items[resource].attr_first = first;
            b->resources.items[resource].attr_count = count;
        } else if (f.num == 2) {
            if (f.wt != 2 || !parse_scope_spans(b, f.p, f.p + f.n, w, resource)) return 0;
        } else if (f.num == 3) {
            if (f.wt != 2 || !utf8_ok(f.p, f.n)) return 0;
        } else {
            return 0;
        }
    }
    return 1;
}

static int parse_request(Batch *b, const uint8_t *p, const uint8_t *end, const Window *w) {
    Field f;
    while (p < end) {
        if (!next_field(&p, end, &f)) return 0;
        if (f.num != 1 || f.wt != 2) return 0;
        if (!parse_resource_spans(b, f.p, f.p + f.n, w)) return 0;
    }
    return 1;
}

static PyTypeObject BatchType;

/* ---------------------------------------------------------------------------------------------- */
/* Python objects (GIL held) */

static PyObject *SpanViewType, *SpanEventType, *Dumps, *EmptyStr;

/* Short strings repeat from span to span (keys, models, operation names): a small table of the
 * str objects made for them, cleared when half full. Owned by the module, used with the GIL. */
#define CACHE_SIZE 8192
#define CACHE_MAX_LEN 96
typedef struct {
    uint64_t hash;
    uint32_t len;
    char *bytes;
    PyObject *str;
} CacheEntry;
static CacheEntry cache[CACHE_SIZE];
static uint32_t cache_used;

static void cache_clear(void) {
    for (uint32_t i = 0; i < CACHE_SIZE; i++) {
        if (cache[i].str) {
            Py_DECREF(cache[i].str);
            PyMem_RawFree(cache[i].bytes);
            cache[i].str = NULL;
            cache[i].bytes = NULL;
        }
    }
    cache_used = 0;
}

static PyObject *make_str(Str s) {
    /* validated UTF-8 already */
    if (s.n == 0) {
        Py_INCREF(EmptyStr);
        return EmptyStr;
    }
    if (s.n > CACHE_MAX_LEN) return PyUnicode_DecodeUTF8(s.p, s.n, NULL);
    uint64_t h = 1469598103934665603ull;
    for (Py_ssize_t i = 0; i < s.n; i++) h = (h ^ (uint8_t)s.p[i]) * 1099511628211ull;
    uint32_t slot = (uint32_t)(h ^ (h >> 29)) & (CACHE_SIZE - 1);
    for (;;) {
        CacheEntry *e = &cache[slot];
        if (!e->str) break;
        if (e->hash == h && e->len == (uint32_t)s.n && memcmp(e->bytes, s.p, s.n) == 0) {
            Py_INCREF(e->str);
            return e->str;
        }
        slot = (slot + 1) & (CACHE_SIZE - 1);
    }
    PyObject *str = PyUnicode_DecodeUTF8(s.p, s.n, NULL);
    if (!str) return NULL;
    if (cache_used >= CACHE_SIZE / 2) {
        cache_clear();
        slot = (uint32_t)(h ^ (h >> 29)) & (CACHE_SIZE - 1);
    }
    char *copy = PyMem_RawMalloc(s.n);
    if (!copy) return str;
    memcpy(copy, s.p, s.n);
    CacheEntry *e = &cache[slot];
    e->hash = h;
    e->len = (uint32_t)s.n;
    e->bytes = copy;
    Py_INCREF(str);
    e->str = str;
    cache_used++;
    return str;
}

static const char HEX[] = "0123456789abcdef";

static PyObject *make_hex(const uint8_t *p, Py_ssize_t n) {
    PyObject *out = PyUnicode_New(n * 2, 127);
    if (!out) return NULL;
    Py_UCS1 *d = PyUnicode_1BYTE_DATA(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        d[2 * i] = HEX[p[i] >> 4];
        d[2 * i + 1] = HEX[p[i] & 15];
    }
    return out;
}

static PyObject *make_value(const Batch *b, const Attr *a) {
    switch (a->type) {
    case V_STR:
        return make_str(a->s);
    case V_INT:
        return PyLong_FromLongLong(a->i);
    case V_BOOL:
        return PyBool_FromLong((long)a->i);
    case V_DOUBLE: {
        double d = a->d;
        if (d - d == 0.0) return PyFloat_FromDouble(d);
        PyObject *f = PyFloat_FromDouble(d); /* NaN and ±inf stay as their repr, as text */
        if (!f) return NULL;
        PyObject *r = PyObject_Repr(f);
        Py_DECREF(f);
        return r;
    }
    case V_ARRAY: {
        PyObject *list = PyList_New(a->count);
        if (!list) return NULL;
        for (uint32_t i = 0; i < a->count; i++) {
            PyObject *v = make_value(b, &b->elems.items[a->first + i]);
            if (!v) {
                Py_DECREF(list);
                return NULL;
            }
            PyList_SET_ITEM(list, i, v);
        }
        return list;
    }
    default:
        Py_RETURN_NONE;
    }
}

static PyObject *make_attrs(const Batch *b, uint32_t first, uint32_t count) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (uint32_t i = 0; i < count; i++) {
        const Attr *a = &b->attrs.items[first + i];
        PyObject *k = make_str(a->key);
        PyObject *v = k ? make_value(b, a) : NULL;
        if (!v || PyDict_SetItem(d, k, v) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return d;
}

/* (spans, dropped, resources): SpanView objects, their dropped-attribute counts, the resource dicts. */
static PyObject *build_views(Batch *b) {
    PyObject *spans = NULL, *dropped = NULL, *resources = NULL, *scopes = NULL, *out = NULL;
    uint32_t n = b->spans.n;
    if (!(spans = PyList_New(n)) || !(dropped = PyList_New(n)) || !(resources = PyList_New(b->resources.n)) ||
        !(scopes = PyList_New(2 * (Py_ssize_t)b->scopes.n)))
        goto done;
    for (uint32_t r = 0; r < b->resources.n; r++) {
        PyObject *d = make_attrs(b, b->resources.items[r].attr_first, b->resources.items[r].attr_count);
        if (!d) goto done;
        PyList_SET_ITEM(resources, r, d);
    }
    for (uint32_t c = 0; c < b->scopes.n; c++) {
        PyObject *name = make_str(b->scopes.items[c].name);
        if (!name) goto done;
        PyList_SET_ITEM(scopes, 2 * c, name);
        PyObject *version = make_str(b->scopes.items[c].version);
        if (!version) goto done;
        PyList_SET_ITEM(scopes, 2 * c + 1, version);
    }
    for (uint32_t i = 0; i < n; i++) {
        const SpanRec *s = &b->spans.items[i];
        PyObject *args[15] = {0};
        PyObject *view = NULL;
        int ok = 0;
        if (!(args[0] = make_hex(s->trace_id, 16)) || !(args[1] = make_hex(s->span_id, 8))) goto span_done;
        if (s->parent) {
            if (!(args[2] = make_hex(s->parent, 8))) goto span_done;
        } else {
            Py_INCREF(EmptyStr);
            args[2] = EmptyStr;
        }
        if (!(args[3] = make_str(s->name)) || !(args[4] = PyLong_FromLong(s->kind)) ||
            !(args[5] = PyLong_FromUnsignedLongLong(s->start)) || !(args[6] = PyLong_FromUnsignedLongLong(s->end)) ||
            !(args[7] = PyLong_FromLong(s->status_code)) || !(args[8] = make_str(s->status_message)) ||
            !(args[9] = make_attrs(b, s->attr_first, s->attr_count)) || !(args[10] = PyList_New(s->event_count)) ||
            !(args[14] = PyList_New(s->link_count)))
            goto span_done;
        for (uint32_t e = 0; e < s->event_count; e++) {
            const EventRec *ev = &b->events.items[s->event_first + e];
            PyObject *eargs[3] = {PyLong_FromUnsignedLongLong(ev->time), make_str(ev->name),
                                  make_attrs(b, ev->attr_first, ev->attr_count)};
            PyObject *event = NULL;
            if (eargs[0] && eargs[1] && eargs[2]) event = PyObject_Vectorcall(SpanEventType, eargs, 3, NULL);
            Py_XDECREF(eargs[0]);
            Py_XDECREF(eargs[1]);
            Py_XDECREF(eargs[2]);
            if (!event) goto span_done;
            PyList_SET_ITEM(args[10], e, event);
        }
        for (uint32_t l = 0; l < s->link_count; l++) {
            const LinkRec *lk = &b->links.items[s->link_first + l];
            PyObject *t = make_hex((const uint8_t *)lk->trace_id.p, lk->trace_id.n);
            PyObject *sp = make_hex((const uint8_t *)lk->span_id.p, lk->span_id.n);
            PyObject *pair = (t && sp) ? PyTuple_Pack(2, t, sp) : NULL;
            Py_XDECREF(t);
            Py_XDECREF(sp);
            if (!pair) goto span_done;
            PyList_SET_ITEM(args[14], l, pair);
        }
        args[11] = PyList_GET_ITEM(resources, s->resource);
        Py_INCREF(args[11]);
        args[12] = PyList_GET_ITEM(scopes, 2 * s->scope);
        Py_INCREF(args[12]);
        args[13] = PyList_GET_ITEM(scopes, 2 * s->scope + 1);
        Py_INCREF(args[13]);
        view = PyObject_Vectorcall(SpanViewType, args, 15, NULL);
        if (!view) goto span_done;
        PyList_SET_ITEM(spans, i, view);
        PyObject *dr = PyLong_FromUnsignedLong(s->dropped);
        if (!dr) goto span_done;
        PyList_SET_ITEM(dropped, i, dr);
        ok = 1;
    span_done:
        for (int k = 0; k < 15; k++) Py_XDECREF(args[k]);
        if (!ok) goto done;
    }
    out = PyTuple_Pack(3, spans, dropped, resources);
done:
    Py_XDECREF(spans);
    Py_XDECREF(dropped);
    Py_XDECREF(resources);
    Py_XDECREF(scopes);
    return out;
}

/* parse(data, max_attributes, max_value_bytes, max_events, earliest_ns, latest_ns, max_duration_ns)
 *   -> Batch | None. Reads and checks the whole request without the GIL; no Python object is made. */
static PyObject *fast_parse(PyObject *module, PyObject *args) {
    PyObject *data;
    unsigned long long max_attributes, max_value_bytes, max_events, earliest, latest, max_duration;
    if (!PyArg_ParseTuple(args, "OKKKKKK", &data, &max_attributes, &max_value_bytes, &max_events, &earliest,
                          &latest, &max_duration))
        return NULL;
    Batch *b = PyObject_New(Batch, &BatchType);
    if (!b) return NULL;
    memset((char *)b + sizeof(PyObject), 0, sizeof(Batch) - sizeof(PyObject));
    if (PyObject_GetBuffer(data, &b->view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(b);
        return NULL;
    }
    b->has_view = 1;
    b->max_attributes = max_attributes > 0xFFFFFFFFu ? 0xFFFFFFFFu : (uint32_t)max_attributes;
    b->max_events = max_events > 0xFFFFFFFFu ? 0xFFFFFFFFu : (uint32_t)max_events;
    b->max_value_bytes = max_value_bytes;
    Window w = {earliest, latest, max_duration};
    const uint8_t *p = b->view.buf;
    const uint8_t *end = p + b->view.len;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = parse_request(b, p, end, &w);
    Py_END_ALLOW_THREADS
    if (!ok) {
        Py_DECREF(b);
        Py_RETURN_NONE;
    }
    return (PyObject *)b;
}

/* batch.views() -> (spans, dropped, resources) */
static PyObject *Batch_views(Batch *self, PyObject *unused) {
    if (!SpanViewType) {
        PyErr_SetString(PyExc_RuntimeError, "configure() first");
        return NULL;
    }
    return build_views(self);
}

/* ---------------------------------------------------------------------------------------------- */
/* JSON rows (no GIL), as orjson writes ingest.rows.span_row's lists */

static void json_str(Buf *o, const char *s, Py_ssize_t n) {
    if (!buf_reserve(o, (size_t)n * 6 + 2)) return;
    char *d = o->p + o->n;
    *d++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *d++ = (char)c;
            continue;
        }
        *d++ = '\\';
        switch (c) {
        case '"': *d++ = '"'; break;
        case '\\': *d++ = '\\'; break;
        case '\n': *d++ = 'n'; break;
        case '\r': *d++ = 'r'; break;
        case '\t': *d++ = 't'; break;
        case '\b': *d++ = 'b'; break;
        case '\f': *d++ = 'f'; break;
        default:
            *d++ = 'u'; *d++ = '0'; *d++ = '0';
            *d++ = HEX[c >> 4];
            *d++ = HEX[c & 15];
        }
    }
    *d++ = '"';
    o->n = d - o->p;
}

/* Decimal digits of v into the end of tmp (at least 20 bytes); returns the first. */
static inline char *u64_digits(uint64_t v, char *end) {
    char *d = end;
    do {
        *--d = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return d;
}

static void json_u64(Buf *o, uint64_t v) {
    char tmp[24];
    char *d = u64_digits(v, tmp + sizeof tmp);
    buf_put(o, d, tmp + sizeof tmp - d);
}

static void json_i64(Buf *o, int64_t v) {
    if (v < 0) {
        buf_ch(o, '-');
        json_u64(o, (uint64_t)0 - (uint64_t)v);
    } else {
        json_u64(o, (uint64_t)v);
    }
}

static void json_hex(Buf *o, const uint8_t *p, Py_ssize_t n) {
    if (!buf_reserve(o, (size_t)n * 2 + 2)) return;
    char *d = o->p + o->n;
    *d++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        *d++ = HEX[p[i] >> 4];
        *d++ = HEX[p[i] & 15];
    }
    *d++ = '"';
    o->n = d - o->p;
}

/* ingest.rows.ns_text as a JSON string. */
static void json_ns(Buf *o, uint64_t ns) {
    char tmp[64];
    int n;
    if (ns >= 1000000000000000000ull) {
        /* "<seconds>.<9 digits>" */
        char *end = tmp + sizeof tmp;
        uint64_t fraction = ns % 1000000000ull;
        *--end = '"';
        for (int i = 0; i < 9; i++) {
            *--end = (char)('0' + fraction % 10);
            fraction /= 10;
        }
        *--end = '.';
        char *d = u64_digits(ns / 1000000000ull, end);
        *--d = '"';
        buf_put(o, d, tmp + sizeof tmp - d);
        return;
    } else {
        time_t seconds = (time_t)(ns / 1000000000ull);
        struct tm tm;
        gmtime_r(&seconds, &tm);
        n = snprintf(tmp, sizeof tmp, "\"%04d-%02d-%02d %02d:%02d:%02d.%09llu\"", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (unsigned long long)(ns % 1000000000ull));
    }
    buf_put(o, tmp, n);
}

static void json_value(Buf *o, const Batch *b, const Attr *a, const char *texts) {
    switch (a->type) {
    case V_STR:
        json_str(o, a->s.p, a->s.n);
        break;
    case V_INT:
        json_i64(o, a->i);
        break;
    case V_BOOL:
        if (a->i) buf_put(o, "true", 4);
        else buf_put(o, "false", 5);
        break;
    case V_DOUBLE:
        if (is_finite(a->d)) buf_put(o, texts + a->text, a->text_n);
        else if (a->d != a->d) buf_put(o, "\"nan\"", 5);
        else if (a->d > 0) buf_put(o, "\"inf\"", 5);
        else buf_put(o, "\"-inf\"", 6);
        break;
    case V_ARRAY:
        buf_ch(o, '[');
        for (uint32_t i = 0; i < a->count; i++) {
            if (i) buf_ch(o, ',');
            json_value(o, b, &b->elems.items[a->first + i], texts);
        }
        buf_ch(o, ']');
        break;
    default:
        buf_put(o, "null", 4);
    }
}

static void json_attrs(Buf *o, const Batch *b, uint32_t first, uint32_t count, const char *texts) {
    buf_ch(o, '{');
    for (uint32_t i = 0; i < count; i++) {
        const Attr *a = &b->attrs.items[first + i];
        if (i) buf_ch(o, ',');
        json_str(o, a->key.p, a->key.n);
        buf_ch(o, ':');
        json_value(o, b, a, texts);
    }
    buf_ch(o, '}');
}

/* The finite doubles' JSON texts, written by orjson itself (the Python path's writer): one
 * orjson.dumps of the list of them all, cut at its commas, each Attr pointing at its text.
 * Non-finite values are written as strings ("nan"), as ingest.otlp makes them (json_value).
 * GIL held; *encoded keeps the texts (NULL when the batch has no finite double). */
static int double_texts(Batch *b, PyObject **encoded) {
    AttrVec *vecs[2] = {&b->attrs, &b->elems};
    Py_ssize_t count = 0, k = 0;
    *encoded = NULL;
    for (int v = 0; v < 2; v++)
        for (uint32_t i = 0; i < vecs[v]->n; i++)
            if (vecs[v]->items[i].type == V_DOUBLE && is_finite(vecs[v]->items[i].d)) count++;
    if (!count) return 1;
    PyObject *list = PyList_New(count);
    if (!list) return 0;
    for (int v = 0; v < 2; v++) {
        for (uint32_t i = 0; i < vecs[v]->n; i++) {
            const Attr *a = &vecs[v]->items[i];
            if (a->type != V_DOUBLE || !is_finite(a->d)) continue;
            PyObject *f = PyFloat_FromDouble(a->d);
            if (!f) {
                Py_DECREF(list);
                return 0;
            }
            PyList_SET_ITEM(list, k++, f);
        }
    }
    PyObject *out = PyObject_CallOneArg(Dumps, list);
    Py_DECREF(list);
    if (!out) return 0;
    if (!PyBytes_Check(out)) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_TypeError, "dumps() must return bytes");
        return 0;
    }
    const char *t = PyBytes_AS_STRING(out);
    Py_ssize_t n = PyBytes_GET_SIZE(out) - 1; /* without the closing ']' */
    Py_ssize_t pos = 1;                        /* after the opening '[' */
    for (int v = 0; v < 2; v++) {
        for (uint32_t i = 0; i < vecs[v]->n; i++) {
            Attr *a = &vecs[v]->items[i];
            if (a->type != V_DOUBLE || !is_finite(a->d)) continue;
            Py_ssize_t end = pos;
            while (end < n && t[end] != ',') end++;
            a->text = (uint32_t)pos;
            a->text_n = (uint32_t)(end - pos);
            pos = end + 1;
        }
    }
    *encoded = out;
    return 1;
}

static void write_rows(Buf *o, const Batch *b, int64_t project_id, int64_t retention, const Str *conventions,
                       const uint64_t *rids, const Str *services, const char *texts) {
    char head[48];
    int head_n = snprintf(head, sizeof head, "[%lld,", (long long)project_id);
    for (uint32_t i = 0; i < b->spans.n && !o->failed; i++) {
        const SpanRec *s = &b->spans.items[i];
        if (i) buf_ch(o, ',');
        buf_put(o, head, head_n);
        json_hex(o, s->trace_id, 16);
        buf_ch(o, ',');
        json_hex(o, s->span_id, 8);
        buf_ch(o, ',');
        if (s->parent) json_hex(o, s->parent, 8);
        else buf_put(o, "\"\"", 2);
        buf_ch(o, ',');
        json_ns(o, s->start);
        buf_ch(o, ',');
        json_ns(o, s->end);
        buf_ch(o, ',');
        json_str(o, s->name.p, s->name.n);
        buf_ch(o, ',');
        json_i64(o, s->kind);
        buf_ch(o, ',');
        json_i64(o, s->status_code);
        buf_ch(o, ',');
        json_str(o, s->status_message.p, s->status_message.n);
        buf_ch(o, ',');
        json_str(o, services[s->resource].p, services[s->resource].n);
        buf_ch(o, ',');
        const ScopeRec *sc = &b->scopes.items[s->scope];
        json_str(o, sc->name.p, sc->name.n);
        buf_ch(o, ',');
        json_str(o, sc->version.p, sc->version.n);
        buf_put(o, ",{},", 4); /* resource attributes: in span_resources (a resource without any has rid 0, {} too) */
        json_attrs(o, b, s->attr_first, s->attr_count, texts);
        buf_ch(o, ',');
        /* events: times, names, attributes */
        const EventRec *ev = b->events.items + s->event_first;
        buf_ch(o, '[');
        for (uint32_t e = 0; e < s->event_count; e++) {
            if (e) buf_ch(o, ',');
            json_ns(o, ev[e].time <= (uint64_t)INT64_MAX ? ev[e].time : 0);
        }
        buf_put(o, "],[", 3);
        for (uint32_t e = 0; e < s->event_count; e++) {
            if (e) buf_ch(o, ',');
            json_str(o, ev[e].name.p, ev[e].name.n);
        }
        buf_put(o, "],[", 3);
        for (uint32_t e = 0; e < s->event_count; e++) {
            if (e) buf_ch(o, ',');
            json_attrs(o, b, ev[e].attr_first, ev[e].attr_count, texts);
        }
        buf_put(o, "],[", 3);
        const LinkRec *lk = b->links.items + s->link_first;
        for (uint32_t l = 0; l < s->link_count; l++) {
            if (l) buf_ch(o, ',');
            json_hex(o, (const uint8_t *)lk[l].trace_id.p, lk[l].trace_id.n);
        }
        buf_put(o, "],[", 3);
        for (uint32_t l = 0; l < s->link_count; l++) {
            if (l) buf_ch(o, ',');
            json_hex(o, (const uint8_t *)lk[l].span_id.p, lk[l].span_id.n);
        }
        buf_put(o, "],", 2);
        json_u64(o, s->dropped);
        buf_ch(o, ',');
        json_str(o, conventions[i].p, conventions[i].n);
        buf_ch(o, ',');
        json_i64(o, retention);
        buf_ch(o, ',');
        json_u64(o, rids[s->resource]);
        buf_ch(o, ']');
    }
}

/* The span's service: its resource's string "service.name" when not empty, else "unknown_service". */
static Str service_of(const Batch *b, uint32_t r) {
    const ResourceRec *rec = &b->resources.items[r];
    for (uint32_t i = 0; i < rec->attr_count; i++) {
        const Attr *a = &b->attrs.items[rec->attr_first + i];
        if (a->key.n == 12 && memcmp(a->key.p, "service.name", 12) == 0 && a->type == V_STR && a->s.n > 0)
            return (Str){a->s.p, a->s.n};
    }
    return (Str){"unknown_service", 15};
}

/* batch.span_rows(project_id, retention_days, conventions, rids) -> bytes
 *   conventions: one str per span ("" for none); rids: one resource id per resource, in order. */
static PyObject *Batch_span_rows(Batch *self, PyObject *args) {
    long long project_id, retention;
    PyObject *conventions, *rids;
    if (!PyArg_ParseTuple(args, "LLO!O!", &project_id, &retention, &PyList_Type, &conventions, &PyList_Type, &rids))
        return NULL;
    uint32_t n = self->spans.n, nr = self->resources.n;
    if (PyList_GET_SIZE(conventions) != n || PyList_GET_SIZE(rids) != nr) {
        PyErr_SetString(PyExc_ValueError, "one convention per span and one resource id per resource");
        return NULL;
    }
    PyObject *result = NULL;
    Buf out = {0};
    PyObject *encoded = NULL;
    Str *conv = PyMem_RawMalloc(sizeof(Str) * (n ? n : 1));
    Str *services = PyMem_RawMalloc(sizeof(Str) * (nr ? nr : 1));
    uint64_t *rid = PyMem_RawMalloc(sizeof(uint64_t) * (nr ? nr : 1));
    if (!conv || !services || !rid) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint32_t i = 0; i < n; i++) {
        PyObject *c = PyList_GET_ITEM(conventions, i);
        if (!PyUnicode_Check(c)) {
            PyErr_SetString(PyExc_TypeError, "conventions must be str");
            goto done;
        }
        conv[i].p = PyUnicode_AsUTF8AndSize(c, &conv[i].n);
        if (!conv[i].p) goto done;
    }
    for (uint32_t r = 0; r < nr; r++) {
        rid[r] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(rids, r));
        if (rid[r] == (uint64_t)-1 && PyErr_Occurred()) goto done;
        services[r] = service_of(self, r);
    }
    if (!double_texts(self, &encoded)) goto done;
    /* `conventions` (an argument) keeps the UTF-8 buffers alive while the GIL is released. */
    Py_BEGIN_ALLOW_THREADS
    buf_reserve(&out, (size_t)self->view.len * 2 + 1024);
    write_rows(&out, self, project_id, retention, conv, rid, services, encoded ? PyBytes_AS_STRING(encoded) : "");
    Py_END_ALLOW_THREADS
    if (out.failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyBytes_FromStringAndSize(out.p, out.n);
done:
    PyMem_RawFree(out.p);
    Py_XDECREF(encoded);
    PyMem_RawFree(conv);
    PyMem_RawFree(services);
    PyMem_RawFree(rid);
    return result;
}

static PyMethodDef Batch_methods[] = {
    {"views", (PyCFunction)Batch_views, METH_NOARGS,
     "views() -> (spans, dropped, resources): the SpanViews, their dropped-attribute counts, the resource dicts"},
    {"span_rows", (PyCFunction)Batch_span_rows, METH_VARARGS,
     "span_rows(project_id, retention_days, conventions, rids) -> bytes: the spans' JSONCompactEachRow rows"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ingest._otlp_fast.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The parsed spans of one OTLP request (see parse).",
    .tp_methods = Batch_methods,
};

/* configure(SpanView, SpanEvent, dumps): the classes views() builds, and orjson.dumps. */
static PyObject *fast_configure(PyObject *module, PyObject *args) {
    PyObject *view, *event, *dumps;
    if (!PyArg_ParseTuple(args, "OOO", &view, &event, &dumps)) return NULL;
    Py_INCREF(view);
    Py_INCREF(event);
    Py_INCREF(dumps);
    Py_XSETREF(SpanViewType, view);
    Py_XSETREF(SpanEventType, event);
    Py_XSETREF(Dumps, dumps);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"parse", fast_parse, METH_VARARGS,
     "parse(data, max_attributes, max_value_bytes, max_events, earliest_ns, latest_ns, max_duration_ns)"
     " -> Batch, or None when the payload is not one this module handles"},
    {"configure", fast_configure, METH_VARARGS, "configure(SpanView, SpanEvent, orjson.dumps)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ingest._otlp_fast", "The C fast path of OTLP/protobuf ingest (see ingest/otlp.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__otlp_fast(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "ingest._otlp_fast reads little-endian fixed64 fields in place");
        return NULL;
    }
    if (PyType_Ready(&BatchType) < 0) return NULL;
    EmptyStr = PyUnicode_FromStringAndSize("", 0);
    if (!EmptyStr) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    Py_INCREF(&BatchType);
    if (PyModule_AddObject(m, "Batch", (PyObject *)&BatchType) < 0) {
        Py_DECREF(&BatchType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
