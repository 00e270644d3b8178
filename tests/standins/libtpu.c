/*
 * A stand-in for libtpu.so with the real PJRT C API shapes that devtrace's
 * TPU shim uses: GetPjrtApi, the PJRT_Api header and its extension chain, and
 * the profiler extension (PLUGIN_Profiler_Api, PLUGIN_PROFILER_VERSION 1).
 *
 * The trace is honest in time, as a real TPU's would be: start and stop
 * take CLOCK_REALTIME, and collect_data returns an XSpace with one plane
 * /device:TPU:0 whose line "XLA Ops" (timestamp_ns = the start) holds one
 * event "fusion.42" of 500 us at every whole millisecond between start and
 * stop. A session started late or stopped early shows as missing events.
 * The bytes come with a trailing NUL byte, as one libtpu version adds,
 * through a plugin-owned buffer.
 * DEVTRACE_TPU_STANDIN_FAIL selects a failure: no_extension, create, start,
 * collect. Built with -DSTANDIN_TPU_ABORT_ON_LOAD, its initialiser aborts the
 * process that loads it, as a broken vendor library's can.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef STANDIN_TPU_ABORT_ON_LOAD
__attribute__((constructor)) static void abort_on_load(void) { abort(); }
#endif

typedef struct PJRT_Extension_Base {
    size_t struct_size;
    int type; /* PJRT_Extension_Type */
    struct PJRT_Extension_Base *next;
} PJRT_Extension_Base;

typedef struct {
    size_t struct_size;
    PJRT_Extension_Base *extension_start;
    int major_version;
    int minor_version;
} PJRT_Api_Version;

typedef struct PLUGIN_Profiler_Error { char message[256]; int code; } PLUGIN_Profiler_Error;
typedef struct PLUGIN_Profiler { int started; int stopped; int64_t start_ns, stop_ns; } PLUGIN_Profiler;

typedef struct { size_t struct_size; void *priv; PLUGIN_Profiler_Error *error; } PLUGIN_Profiler_Error_Destroy_Args;
typedef struct {
    size_t struct_size; void *priv; const PLUGIN_Profiler_Error *error;
    const char *message; size_t message_size;
} PLUGIN_Profiler_Error_Message_Args;
typedef struct { size_t struct_size; void *priv; const PLUGIN_Profiler_Error *error; int code; } PLUGIN_Profiler_Error_GetCode_Args;
typedef struct { size_t struct_size; const char *options; size_t options_size; PLUGIN_Profiler *profiler; } PLUGIN_Profiler_Create_Args;
typedef struct { size_t struct_size; PLUGIN_Profiler *profiler; } PLUGIN_Profiler_Simple_Args;
typedef struct { size_t struct_size; PLUGIN_Profiler *profiler; uint8_t *buffer; size_t buffer_size_in_bytes; } PLUGIN_Profiler_CollectData_Args;

typedef struct {
    size_t struct_size;
    void *priv;
    void (*error_destroy)(PLUGIN_Profiler_Error_Destroy_Args *);
    void (*error_message)(PLUGIN_Profiler_Error_Message_Args *);
    PLUGIN_Profiler_Error *(*error_get_code)(PLUGIN_Profiler_Error_GetCode_Args *);
    PLUGIN_Profiler_Error *(*create)(PLUGIN_Profiler_Create_Args *);
    PLUGIN_Profiler_Error *(*destroy)(PLUGIN_Profiler_Simple_Args *);
    PLUGIN_Profiler_Error *(*start)(PLUGIN_Profiler_Simple_Args *);
    PLUGIN_Profiler_Error *(*stop)(PLUGIN_Profiler_Simple_Args *);
    PLUGIN_Profiler_Error *(*collect_data)(PLUGIN_Profiler_CollectData_Args *);
} PLUGIN_Profiler_Api;

typedef struct {
    size_t struct_size;
    int type;
    PJRT_Extension_Base *next;
    PLUGIN_Profiler_Api *profiler_api;
    int64_t traceme_context_id;
} PJRT_Profiler_Extension;

/* The head of PJRT_Api: the shim reads no further than these fields. */
typedef struct {
    size_t struct_size;
    PJRT_Extension_Base *extension_start;
    PJRT_Api_Version pjrt_api_version;
    void *functions[8];
} PJRT_Api;

static int failing(const char *what) {
    const char *fail = getenv("DEVTRACE_TPU_STANDIN_FAIL");
    return fail && strcmp(fail, what) == 0;
}

static PLUGIN_Profiler_Error *error(const char *message, int code) {
    PLUGIN_Profiler_Error *e = calloc(1, sizeof *e);
    snprintf(e->message, sizeof e->message, "%s", message);
    e->code = code;
    return e;
}

static void error_destroy(PLUGIN_Profiler_Error_Destroy_Args *a) { free(a->error); }
static void error_message(PLUGIN_Profiler_Error_Message_Args *a) {
    a->message = a->error->message;
    a->message_size = strlen(a->error->message);
}
static PLUGIN_Profiler_Error *error_get_code(PLUGIN_Profiler_Error_GetCode_Args *a) {
    a->code = a->error->code;
    return NULL;
}

static int64_t realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- a small protobuf writer for the XSpace -------------------------------- */

struct out { uint8_t *bytes; size_t used, size; };

static void put(struct out *o, const void *data, size_t n) {
    if (o->used + n > o->size) {
        size_t size = (o->size ? o->size * 2 : 256) + n;
        uint8_t *grown = realloc(o->bytes, size);
        if (!grown) abort();
        o->bytes = grown;
        o->size = size;
    }
    memcpy(o->bytes + o->used, data, n);
    o->used += n;
}
static void varint(struct out *o, uint64_t v) {
    uint8_t b[10];
    size_t n = 0;
    do {
        b[n] = (uint8_t)(v & 0x7f);
        v >>= 7;
        if (v) b[n] |= 0x80;
        n++;
    } while (v);
    put(o, b, n);
}
static void field_int(struct out *o, int field, int64_t v) { varint(o, (uint64_t)field << 3); varint(o, (uint64_t)v); }
static void field_bytes(struct out *o, int field, const void *data, size_t n) {
    varint(o, ((uint64_t)field << 3) | 2);
    varint(o, n);
    put(o, data, n);
}
static void field_message(struct out *o, int field, struct out *m) {
    field_bytes(o, field, m->bytes, m->used);
    free(m->bytes);
    *m = (struct out){0};
}

/* XSpace{planes: [XPlane{id 0, name, event_metadata {1: fusion.42},
 * lines: [XLine{id 1, name "XLA Ops", timestamp_ns start, events ...}]}]} */
static struct out tpu_xspace(int64_t start_ns, int64_t stop_ns) {
    struct out line = {0}, plane = {0}, space = {0}, event = {0}, meta = {0}, entry = {0};
    field_int(&line, 1, 1);
    field_bytes(&line, 2, "XLA Ops", 7);
    field_int(&line, 3, start_ns);
    for (int64_t at = 0; at <= stop_ns - start_ns; at += 1000000) {
        field_int(&event, 1, 1);          /* metadata_id */
        field_int(&event, 2, at * 1000);  /* offset_ps */
        field_int(&event, 3, 500000000);  /* duration_ps: 500 us */
        field_message(&line, 4, &event);
    }
    field_int(&plane, 1, 0);
    field_bytes(&plane, 2, "/device:TPU:0", 13);
    field_message(&plane, 3, &line);
    field_int(&meta, 1, 1);
    field_bytes(&meta, 2, "fusion.42", 9);
    field_int(&entry, 1, 1);
    field_message(&entry, 2, &meta);
    field_message(&plane, 4, &entry);
    field_message(&space, 1, &plane);
    return space;
}

static PLUGIN_Profiler_Error *create(PLUGIN_Profiler_Create_Args *a) {
    if (failing("create")) return error("TPU is owned by another process (stand-in)", 9);
    if (a->options_size > 0 && a->options == NULL) return error("options missing", 3);
    a->profiler = calloc(1, sizeof(PLUGIN_Profiler));
    return NULL;
}
static PLUGIN_Profiler_Error *destroy(PLUGIN_Profiler_Simple_Args *a) { free(a->profiler); return NULL; }
static PLUGIN_Profiler_Error *start(PLUGIN_Profiler_Simple_Args *a) {
    if (failing("start")) return error("cannot start the TPU tracer (stand-in)", 13);
    a->profiler->started = 1;
    a->profiler->start_ns = realtime_ns();
    return NULL;
}
static PLUGIN_Profiler_Error *stop(PLUGIN_Profiler_Simple_Args *a) {
    a->profiler->stopped = 1;
    a->profiler->stop_ns = realtime_ns();
    return NULL;
}

static uint8_t *owned;
static PLUGIN_Profiler_Error *collect_data(PLUGIN_Profiler_CollectData_Args *a) {
    if (failing("collect")) return error("collect failed (stand-in)", 13);
    if (!a->profiler->started || !a->profiler->stopped) return error("collect before stop", 9);
    struct out space = tpu_xspace(a->profiler->start_ns, a->profiler->stop_ns);
    put(&space, "", 1); /* the trailing byte one libtpu version adds */
    free(owned);
    owned = space.bytes;
    a->buffer = owned;
    a->buffer_size_in_bytes = space.used;
    return NULL;
}

static PLUGIN_Profiler_Api profiler_api = {
    sizeof(PLUGIN_Profiler_Api), NULL, error_destroy, error_message, error_get_code,
    create, destroy, start, stop, collect_data,
};
static PJRT_Profiler_Extension profiler_extension = {
    sizeof(PJRT_Profiler_Extension), 1 /* Profiler */, NULL, &profiler_api, 0,
};
/* Another extension first, as real plugins chain several. */
static PJRT_Extension_Base stream_extension = {
    sizeof(PJRT_Extension_Base), 3 /* Stream */, (PJRT_Extension_Base *)&profiler_extension,
};
static PJRT_Api api;

const PJRT_Api *GetPjrtApi(void) {
    api.struct_size = sizeof api;
    api.extension_start = failing("no_extension") ? NULL : &stream_extension;
    api.pjrt_api_version.struct_size = sizeof api.pjrt_api_version;
    api.pjrt_api_version.major_version = 0;
    api.pjrt_api_version.minor_version = 54;
    return &api;
}
