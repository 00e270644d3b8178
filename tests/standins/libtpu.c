/*
 * A stand-in for libtpu.so with the real PJRT C API shapes that devtrace's
 * TPU shim uses: GetPjrtApi, the PJRT_Api header and its extension chain, and
 * the profiler extension (PLUGIN_Profiler_Api, PLUGIN_PROFILER_VERSION 1).
 *
 * collect_data returns the bytes of the file named by
 * DEVTRACE_TPU_STANDIN_XSPACE plus a trailing NUL byte, as one libtpu version
 * does, through a plugin-owned buffer on the first call.
 * DEVTRACE_TPU_STANDIN_FAIL selects a failure: no_extension, create, start,
 * collect.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
typedef struct PLUGIN_Profiler { int started; int stopped; } PLUGIN_Profiler;

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
    return NULL;
}
static PLUGIN_Profiler_Error *stop(PLUGIN_Profiler_Simple_Args *a) { a->profiler->stopped = 1; return NULL; }

static uint8_t *owned;
static PLUGIN_Profiler_Error *collect_data(PLUGIN_Profiler_CollectData_Args *a) {
    if (failing("collect")) return error("collect failed (stand-in)", 13);
    if (!a->profiler->started || !a->profiler->stopped) return error("collect before stop", 9);
    const char *path = getenv("DEVTRACE_TPU_STANDIN_XSPACE");
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f) return error("no XSpace file for the stand-in", 5);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    free(owned);
    owned = malloc((size_t)size + 1);
    size_t got = fread(owned, 1, (size_t)size, f);
    fclose(f);
    owned[got] = 0; /* the trailing byte one libtpu version adds */
    a->buffer = owned;
    a->buffer_size_in_bytes = got + 1;
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
