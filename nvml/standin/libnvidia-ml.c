/*
 * levers9 stand-in for libnvidia-ml.so.1 (NVIDIA's NVML), for machines without a GPU.
 *
 * Why: the agent's NVML facade calls pynvml, and pynvml calls this library through ctypes exactly
 * as it calls the driver's on a GPU node: same soname, same symbols, same struct layouts (compiled
 * against NVIDIA's own nvml.h, versioned structs checked). Only the answers differ: they come from
 * a JSON description of a node named by the environment variable LEVERS9_NVML_STANDIN, read at
 * every first nvmlInitWithFlags (reference count 0 -> 1), so a test process can describe a new
 * node between two sessions.
 *
 * A card also goes bad while a session is open, and the agent must notice it then. So every call
 * after nvmlInit that takes a card or waits for events first stat()s the description (inode,
 * mtime, size) and, if it changed, reads it again and replaces what the cards answer, keeping the
 * session: handles stay valid by index, event sets stay registered. A test rewrites the file
 * atomically (write_description in nvml/standin/__init__.py: temp file + rename) so the library
 * never reads half of one; a description that does not parse is reported on stderr and ignored.
 * From the next call on, "errors" ("*": "GPU_IS_LOST" makes a card lost), "ecc", "processes" and
 * the rest answer as rewritten. "xid_events" are numbered XIDs that happen while the session runs:
 * an event whose id is above the highest id an event set has seen for that card is queued into
 * every event set registered for the card's critical XIDs, once; events already in the
 * description when a set registers are not replayed to it, as a real driver delivers only what
 * happens after registration. nvmlEventSetWait_v2 looks at the file every 20 ms while it waits,
 * so an event written mid-wait wakes it well before its timeout. ("xids", by contrast, are
 * delivered to every registration, as before: a card's past critical XIDs, for one-shot checks.)
 *
 * It implements exactly the functions the facade (nvml/facade.py) reaches through pynvml; any other
 * symbol is absent, which pynvml reports as NVML_ERROR_FUNCTION_NOT_FOUND, as an old driver would.
 *
 * The description (all keys optional except devices; see nvml/standin/__init__.py):
 *   {"driver_version": "550.54.15", "cuda_driver_version": 12040,
 *    "init_error": "DRIVER_NOT_LOADED",            -- nvmlInitWithFlags fails with this code
 *    "devices": [{"uuid": "GPU-...", "name": "...", "minor": 0, "pci_bus_id": "00000000:07:00.0",
 *                 "pci_device_id": 548540638, "memory_total": 0, "memory_used": 0,
 *                 "memory_reserved": 0, "mig_mode": 0 | 1 | null, "mig_devices": ["MIG-..."],
 *                 "processes": [{"pid": 1, "used_memory": 0}],
 *                 "retired_pages_pending": false | true | null,
 *                 "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": false,
 *                                   "failure": false} | null,
 *                 "ecc": {"uncorrected_volatile": 0, "uncorrected_aggregate": 0,
 *                         "corrected_volatile": 0, "corrected_aggregate": 0} | null,
 *                 "utilization": {"gpu": 0, "memory": 0} | null,   -- percent
 *                 "temperature": 33 | null,                        -- degrees C, GPU die
 *                 "power_usage": 61000 | null,                     -- milliwatts
 *                 "xids": [79], "xid_events_supported": true,
 *                 "xid_events": [{"id": 1, "xid": 79}],            -- ids ascending, from 1
 *                 "errors": {"nvmlDeviceGetName": "GPU_IS_LOST", "*": "GPU_IS_LOST"}}],
 *    "topology": {"nvlink_groups": [[0, 1]], "pcie_switches": [[0, 1]],
 *                 "host_bridges": [[0, 1]], "numa_nodes": [[0, 1]]}}
 * null means "this card does not support the query" (NVML_ERROR_NOT_SUPPORTED). "errors" maps a
 * function name (or "*" for every function taking that device) to an NVML_ERROR_* name without
 * its prefix; it is how a test makes a card stop answering.
 */
#define _GNU_SOURCE /* PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <nvml.h>

#define EXPORT __attribute__((visibility("default")))

#define MAX_DEVICES 64
#define MAX_MIG 8
#define MAX_PROCS 64
#define MAX_XIDS 16
#define MAX_FAULTS 32
#define MAX_EVENTS 256
#define MAX_XID_EVENTS 64 /* the last ones a description lists; older ones are forgotten */
#define WAIT_POLL_MS 20   /* how often a waiting nvmlEventSetWait_v2 looks at the description */

/* ---------------------------------------------------------------------------------------------- */
/* Return codes by name: used for "errors" in the description and for nvmlErrorString.           */

static const struct {
    nvmlReturn_t code;
    const char *name;
    const char *text;
} RETURN_CODES[] = {
    {NVML_SUCCESS, "SUCCESS", "Success"},
    {NVML_ERROR_UNINITIALIZED, "UNINITIALIZED", "Uninitialized"},
    {NVML_ERROR_INVALID_ARGUMENT, "INVALID_ARGUMENT", "Invalid Argument"},
    {NVML_ERROR_NOT_SUPPORTED, "NOT_SUPPORTED", "Not Supported"},
    {NVML_ERROR_NO_PERMISSION, "NO_PERMISSION", "Insufficient Permissions"},
    {NVML_ERROR_ALREADY_INITIALIZED, "ALREADY_INITIALIZED", "Already Initialized"},
    {NVML_ERROR_NOT_FOUND, "NOT_FOUND", "Not Found"},
    {NVML_ERROR_INSUFFICIENT_SIZE, "INSUFFICIENT_SIZE", "Insufficient Size"},
    {NVML_ERROR_INSUFFICIENT_POWER, "INSUFFICIENT_POWER", "Insufficient External Power"},
    {NVML_ERROR_DRIVER_NOT_LOADED, "DRIVER_NOT_LOADED", "Driver Not Loaded"},
    {NVML_ERROR_TIMEOUT, "TIMEOUT", "Timeout"},
    {NVML_ERROR_IRQ_ISSUE, "IRQ_ISSUE", "Interrupt Request Issue"},
    {NVML_ERROR_LIBRARY_NOT_FOUND, "LIBRARY_NOT_FOUND", "NVML Shared Library Not Found"},
    {NVML_ERROR_FUNCTION_NOT_FOUND, "FUNCTION_NOT_FOUND", "Function Not Found"},
    {NVML_ERROR_CORRUPTED_INFOROM, "CORRUPTED_INFOROM", "Corrupted infoROM"},
    {NVML_ERROR_GPU_IS_LOST, "GPU_IS_LOST", "GPU is lost"},
    {NVML_ERROR_RESET_REQUIRED, "RESET_REQUIRED", "GPU requires restart"},
    {NVML_ERROR_OPERATING_SYSTEM, "OPERATING_SYSTEM",
     "The operating system has blocked the request."},
    {NVML_ERROR_LIB_RM_VERSION_MISMATCH, "LIB_RM_VERSION_MISMATCH",
     "RM has detected an NVML/RM version mismatch."},
    {NVML_ERROR_IN_USE, "IN_USE", "In use by another client"},
    {NVML_ERROR_MEMORY, "MEMORY", "Insufficient Memory"},
    {NVML_ERROR_NO_DATA, "NO_DATA", "No data"},
    {NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "ARGUMENT_VERSION_MISMATCH",
     "Argument version mismatch"},
    {NVML_ERROR_NOT_READY, "NOT_READY", "Not ready"},
    {NVML_ERROR_GPU_NOT_FOUND, "GPU_NOT_FOUND", "GPU not found"},
    {NVML_ERROR_INVALID_STATE, "INVALID_STATE", "Invalid state"},
    {NVML_ERROR_UNKNOWN, "UNKNOWN", "Unknown Error"},
};

static int code_by_name(const char *name, nvmlReturn_t *out) {
    const char *bare = strncmp(name, "NVML_ERROR_", 11) == 0 ? name + 11 : name;
    for (size_t i = 0; i < sizeof RETURN_CODES / sizeof RETURN_CODES[0]; i++) {
        if (strcmp(RETURN_CODES[i].name, bare) == 0) {
            *out = RETURN_CODES[i].code;
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* A small JSON reader: enough for the node description, strict about syntax.                     */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
    jtype type;
    int boolean;
    double num;
    int is_uint;               /* the number was written as a non-negative integer */
    unsigned long long uint;   /* ... and this is its exact value */
    char *str;
    size_t n;                  /* items of an array or members of an object */
    struct jval **items;
    char **keys;               /* object member names, parallel to items */
} jval;

typedef struct {
    const char *p;
    const char *end;
    char error[160];
} jparser;

static void jfree(jval *v) {
    if (!v) return;
    for (size_t i = 0; i < v->n; i++) {
        jfree(v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    free(v);
}

static jval *jparse_value(jparser *ps, int depth);

static void jskip_ws(jparser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static jval *jfail(jparser *ps, const char *what) {
    if (!ps->error[0]) snprintf(ps->error, sizeof ps->error, "%s", what);
    return NULL;
}

static jval *jnew(jtype type) {
    jval *v = calloc(1, sizeof *v);
    if (v) v->type = type;
    return v;
}

static int jappend(jval *v, jval *item, char *key) {
    jval **items = realloc(v->items, (v->n + 1) * sizeof *items);
    if (!items) return 0;
    v->items = items;
    if (v->type == J_OBJ) {
        char **keys = realloc(v->keys, (v->n + 1) * sizeof *keys);
        if (!keys) return 0;
        v->keys = keys;
        v->keys[v->n] = key;
    }
    v->items[v->n++] = item;
    return 1;
}

static void put_utf8(char *out, size_t *len, unsigned cp) {
    if (cp < 0x80) {
        out[(*len)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*len)++] = (char)(0xC0 | (cp >> 6));
        out[(*len)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out[(*len)++] = (char)(0xE0 | (cp >> 12));
        out[(*len)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*len)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[(*len)++] = (char)(0xF0 | (cp >> 18));
        out[(*len)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[(*len)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*len)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static int jhex4(jparser *ps, unsigned *out) {
    if (ps->end - ps->p < 4) return 0;
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = ps->p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    ps->p += 4;
    *out = v;
    return 1;
}

/* Parses a string starting at the opening quote; the result is NUL-terminated UTF-8. */
static char *jparse_string(jparser *ps) {
    ps->p++; /* opening quote */
    /* Escapes never make the text longer, except \u which yields at most 4 bytes for 6 read. */
    char *out = malloc((size_t)(ps->end - ps->p) + 1);
    size_t len = 0;
    if (!out) return (char *)jfail(ps, "out of memory");
    while (ps->p < ps->end && *ps->p != '"') {
        unsigned char c = (unsigned char)*ps->p++;
        if (c < 0x20) {
            free(out);
            return (char *)jfail(ps, "control character in string");
        }
        if (c != '\\') {
            out[len++] = (char)c;
            continue;
        }
        if (ps->p >= ps->end) break;
        char e = *ps->p++;
        unsigned cp;
        switch (e) {
        case '"': out[len++] = '"'; break;
        case '\\': out[len++] = '\\'; break;
        case '/': out[len++] = '/'; break;
        case 'b': out[len++] = '\b'; break;
        case 'f': out[len++] = '\f'; break;
        case 'n': out[len++] = '\n'; break;
        case 'r': out[len++] = '\r'; break;
        case 't': out[len++] = '\t'; break;
        case 'u':
            if (!jhex4(ps, &cp)) {
                free(out);
                return (char *)jfail(ps, "bad \\u escape");
            }
            if (cp >= 0xD800 && cp < 0xDC00 && ps->end - ps->p >= 6 && ps->p[0] == '\\' &&
                ps->p[1] == 'u') {
                unsigned low;
                ps->p += 2;
                if (!jhex4(ps, &low) || low < 0xDC00 || low > 0xDFFF) {
                    free(out);
                    return (char *)jfail(ps, "bad surrogate pair");
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            }
            put_utf8(out, &len, cp);
            break;
        default:
            free(out);
            return (char *)jfail(ps, "bad escape in string");
        }
    }
    if (ps->p >= ps->end) {
        free(out);
        return (char *)jfail(ps, "unterminated string");
    }
    ps->p++; /* closing quote */
    out[len] = '\0';
    return out;
}

static jval *jparse_number(jparser *ps) {
    const char *start = ps->p;
    int integral = 1;
    if (ps->p < ps->end && *ps->p == '-') {
        integral = 0;
        ps->p++;
    }
    while (ps->p < ps->end && (isdigit((unsigned char)*ps->p) || *ps->p == '.' || *ps->p == 'e' ||
                               *ps->p == 'E' || *ps->p == '+' || *ps->p == '-')) {
        if (!isdigit((unsigned char)*ps->p)) integral = 0;
        ps->p++;
    }
    char buf[64];
    size_t len = (size_t)(ps->p - start);
    if (len == 0 || len >= sizeof buf) return jfail(ps, "bad number");
    memcpy(buf, start, len);
    buf[len] = '\0';
    char *stop;
    jval *v = jnew(J_NUM);
    if (!v) return jfail(ps, "out of memory");
    v->num = strtod(buf, &stop);
    if (*stop != '\0') {
        jfree(v);
        return jfail(ps, "bad number");
    }
    if (integral) {
        errno = 0;
        v->uint = strtoull(buf, &stop, 10);
        v->is_uint = errno == 0 && *stop == '\0';
    }
    return v;
}

static int jliteral(jparser *ps, const char *word) {
    size_t len = strlen(word);
    if ((size_t)(ps->end - ps->p) < len || strncmp(ps->p, word, len) != 0) return 0;
    ps->p += len;
    return 1;
}

static jval *jparse_value(jparser *ps, int depth) {
    if (depth > 32) return jfail(ps, "nested too deeply");
    jskip_ws(ps);
    if (ps->p >= ps->end) return jfail(ps, "unexpected end of input");
    char c = *ps->p;
    if (c == '{' || c == '[') {
        int object = c == '{';
        char close = object ? '}' : ']';
        jval *v = jnew(object ? J_OBJ : J_ARR);
        if (!v) return jfail(ps, "out of memory");
        ps->p++;
        jskip_ws(ps);
        if (ps->p < ps->end && *ps->p == close) {
            ps->p++;
            return v;
        }
        for (;;) {
            char *key = NULL;
            if (object) {
                jskip_ws(ps);
                if (ps->p >= ps->end || *ps->p != '"') {
                    jfree(v);
                    return jfail(ps, "expected a member name");
                }
                key = jparse_string(ps);
                jskip_ws(ps);
                if (!key || ps->p >= ps->end || *ps->p != ':') {
                    free(key);
                    jfree(v);
                    return jfail(ps, "expected ':' after a member name");
                }
                ps->p++;
            }
            jval *item = jparse_value(ps, depth + 1);
            if (!item || !jappend(v, item, key)) {
                jfree(item);
                free(key);
                jfree(v);
                return jfail(ps, "out of memory");
            }
            jskip_ws(ps);
            if (ps->p < ps->end && *ps->p == ',') {
                ps->p++;
                continue;
            }
            if (ps->p < ps->end && *ps->p == close) {
                ps->p++;
                return v;
            }
            jfree(v);
            return jfail(ps, object ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    }
    if (c == '"') {
        char *s = jparse_string(ps);
        if (!s) return NULL;
        jval *v = jnew(J_STR);
        if (!v) {
            free(s);
            return jfail(ps, "out of memory");
        }
        v->str = s;
        return v;
    }
    if (c == '-' || isdigit((unsigned char)c)) return jparse_number(ps);
    int truth = jliteral(ps, "true");
    if (truth || jliteral(ps, "false")) {
        jval *v = jnew(J_BOOL);
        if (!v) return jfail(ps, "out of memory");
        v->boolean = truth;
        return v;
    }
    if (jliteral(ps, "null")) return jnew(J_NULL);
    return jfail(ps, "unexpected character");
}

static const jval *jget(const jval *obj, const char *key) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (size_t i = 0; i < obj->n; i++)
        if (strcmp(obj->keys[i], key) == 0) return obj->items[i];
    return NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* The node: filled from the description at the first nvmlInitWithFlags.                          */

typedef struct {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char pci_bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned pci_domain, pci_bus, pci_device, pci_device_id;
    unsigned minor;
    unsigned long long memory_total, memory_used, memory_reserved;
    int mig_supported;
    unsigned mig_mode;
    int mig_count;
    char mig_uuid[MAX_MIG][NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    int proc_count;
    unsigned proc_pid[MAX_PROCS];
    unsigned long long proc_memory[MAX_PROCS];
    int retired_pending; /* -1: not supported */
    int rows_supported;
    unsigned rows_corrected, rows_uncorrected, rows_pending, rows_failure;
    int ecc_supported;
    unsigned long long ecc[2][2]; /* [error type][counter type] */
    int util_supported;
    unsigned util_gpu, util_memory; /* percent over the last sample period */
    int temperature_supported;
    int temperature; /* degrees C */
    int power_supported;
    unsigned power_mw;
    int xid_supported;
    int xid_count;
    unsigned long long xids[MAX_XIDS];
    int xid_event_count;
    unsigned long long xid_event_id[MAX_XID_EVENTS], xid_event_xid[MAX_XID_EVENTS];
    int fault_count;
    char fault_fn[MAX_FAULTS][64];
    nvmlReturn_t fault_code[MAX_FAULTS];
    int nvlink_group, pcie_switch, host_bridge, numa_node; /* -1: in no group */
} standin_device;

struct nvmlDevice_st {
    int index;    /* of the physical card */
    int mig_slot; /* -1 for the card itself */
};

struct nvmlEventSet_st {
    struct nvmlEventSet_st *next; /* every live set, so events written later reach it */
    unsigned char registered[MAX_DEVICES]; /* for critical XIDs of that card */
    unsigned long long taken[MAX_DEVICES]; /* the highest xid_events id seen for that card */
    int head, count;
    struct {
        int device;
        unsigned long long xid;
    } queue[MAX_EVENTS];
};

/* Recursive: a function taking two cards enters twice. Held for the whole of every call that reads
 * the node, since a call in another thread may read the description again meanwhile. */
static pthread_mutex_t g_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static int g_refcount;
static char g_driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
static int g_cuda_version;
static int g_device_count;
static standin_device g_devices[MAX_DEVICES];
/* Where the session's description is, and which version of the file was read last. */
static char g_path[4096];
static struct stat g_loaded;
static struct nvmlEventSet_st *g_sets;
/* A description is read into these first, and replaces the node only once it all made sense. */
static char g_next_driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
static int g_next_cuda_version;
static int g_next_device_count;
static standin_device g_next_devices[MAX_DEVICES];
/* Handles stay at fixed addresses for the life of the process, as pointers handed out must. */
static struct nvmlDevice_st g_handles[MAX_DEVICES];
static struct nvmlDevice_st g_mig_handles[MAX_DEVICES][MAX_MIG];

static void complain(const char *path, const char *what) {
    fprintf(stderr, "levers9 NVML stand-in: %s: %s\n", path ? path : "(LEVERS9_NVML_STANDIN unset)",
            what);
}

static void copy_string(char *dst, size_t size, const jval *v, const char *fallback) {
    const char *src = v && v->type == J_STR ? v->str : fallback;
    snprintf(dst, size, "%s", src);
}

static unsigned long long uint_or(const jval *v, unsigned long long fallback) {
    return v && v->type == J_NUM && v->is_uint ? v->uint : fallback;
}

static int bool_or(const jval *v, int fallback) {
    if (!v) return fallback;
    if (v->type == J_BOOL) return v->boolean;
    if (v->type == J_NUM) return v->num != 0;
    return fallback;
}

/* Marks each listed device index with the group's number; returns 0 on a bad index. */
static int load_groups(const jval *groups, size_t field_offset, char *error, size_t error_size,
                       const char *name) {
    if (!groups || groups->type != J_ARR) return 1;
    for (size_t g = 0; g < groups->n; g++) {
        const jval *group = groups->items[g];
        if (group->type != J_ARR) {
            snprintf(error, error_size, "topology.%s[%zu] is not a list", name, g);
            return 0;
        }
        for (size_t i = 0; i < group->n; i++) {
            unsigned long long index = uint_or(group->items[i], (unsigned long long)-1);
            if (index >= (unsigned long long)g_next_device_count) {
                snprintf(error, error_size, "topology.%s[%zu] names a device index that is not there",
                         name, g);
                return 0;
            }
            *(int *)((char *)&g_next_devices[index] + field_offset) = (int)g;
        }
    }
    return 1;
}

/* The XIDs that happen while a session runs, oldest first: the last MAX_XID_EVENTS listed. */
static int load_xid_events(standin_device *dev, int index, const jval *events, char *error,
                           size_t error_size) {
    if (!events || events->type != J_ARR) return 1;
    size_t skip = events->n > MAX_XID_EVENTS ? events->n - MAX_XID_EVENTS : 0;
    for (size_t i = skip; i < events->n; i++) {
        unsigned long long id = uint_or(jget(events->items[i], "id"), 0);
        int count = dev->xid_event_count;
        if (id == 0 || (count > 0 && id <= dev->xid_event_id[count - 1])) {
            snprintf(error, error_size,
                     "devices[%d].xid_events[%zu].id must be 1 or more, above the one before",
                     index, i);
            return 0;
        }
        dev->xid_event_id[dev->xid_event_count] = id;
        dev->xid_event_xid[dev->xid_event_count] = uint_or(jget(events->items[i], "xid"), 999);
        dev->xid_event_count++;
    }
    return 1;
}

static int load_device(int index, const jval *d, char *error, size_t error_size) {
    standin_device *dev = &g_next_devices[index];
    memset(dev, 0, sizeof *dev);
    if (!d || d->type != J_OBJ) {
        snprintf(error, error_size, "devices[%d] is not an object", index);
        return 0;
    }
    char fallback[64];
    snprintf(fallback, sizeof fallback, "GPU-00000000-0000-4000-8000-%012d", index);
    copy_string(dev->uuid, sizeof dev->uuid, jget(d, "uuid"), fallback);
    copy_string(dev->name, sizeof dev->name, jget(d, "name"), "NVIDIA A100-SXM4-80GB");
    char bus_fallback[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    snprintf(bus_fallback, sizeof bus_fallback, "00000000:%02X:00.0", (0x10 + index) & 0xFF);
    copy_string(dev->pci_bus_id, sizeof dev->pci_bus_id, jget(d, "pci_bus_id"), bus_fallback);
    if (sscanf(dev->pci_bus_id, "%x:%x:%x.", &dev->pci_domain, &dev->pci_bus, &dev->pci_device) !=
        3) {
        snprintf(error, error_size, "devices[%d].pci_bus_id is not domain:bus:device.function",
                 index);
        return 0;
    }
    dev->pci_device_id = (unsigned)uint_or(jget(d, "pci_device_id"), 0x20B510DEu);
    dev->minor = (unsigned)uint_or(jget(d, "minor"), (unsigned long long)index);
    dev->memory_total = uint_or(jget(d, "memory_total"), 85899345920ULL);
    dev->memory_used = uint_or(jget(d, "memory_used"), 0);
    dev->memory_reserved = uint_or(jget(d, "memory_reserved"), 0);
    if (dev->memory_used + dev->memory_reserved > dev->memory_total) {
        snprintf(error, error_size, "devices[%d] uses more memory than it has", index);
        return 0;
    }

    const jval *mig = jget(d, "mig_mode");
    dev->mig_supported = !(mig && mig->type == J_NULL);
    dev->mig_mode = (unsigned)bool_or(mig, 0);
    const jval *migs = jget(d, "mig_devices");
    if (migs && migs->type == J_ARR) {
        for (size_t i = 0; i < migs->n && i < MAX_MIG - 1; i++)
            copy_string(dev->mig_uuid[dev->mig_count++], NVML_DEVICE_UUID_V2_BUFFER_SIZE,
                        migs->items[i], "MIG-?");
    }

    const jval *procs = jget(d, "processes");
    if (procs && procs->type == J_ARR) {
        for (size_t i = 0; i < procs->n && i < MAX_PROCS; i++) {
            dev->proc_pid[dev->proc_count] = (unsigned)uint_or(jget(procs->items[i], "pid"), 0);
            dev->proc_memory[dev->proc_count] = uint_or(jget(procs->items[i], "used_memory"), 0);
            dev->proc_count++;
        }
    }

    const jval *retired = jget(d, "retired_pages_pending");
    dev->retired_pending = retired && retired->type == J_NULL ? -1 : bool_or(retired, 0);

    const jval *rows = jget(d, "remapped_rows");
    dev->rows_supported = !(rows && rows->type == J_NULL);
    dev->rows_corrected = (unsigned)uint_or(jget(rows, "corrected"), 0);
    dev->rows_uncorrected = (unsigned)uint_or(jget(rows, "uncorrected"), 0);
    dev->rows_pending = (unsigned)bool_or(jget(rows, "pending"), 0);
    dev->rows_failure = (unsigned)bool_or(jget(rows, "failure"), 0);

    const jval *ecc = jget(d, "ecc");
    dev->ecc_supported = !(ecc && ecc->type == J_NULL);
    dev->ecc[NVML_MEMORY_ERROR_TYPE_CORRECTED][NVML_VOLATILE_ECC] =
        uint_or(jget(ecc, "corrected_volatile"), 0);
    dev->ecc[NVML_MEMORY_ERROR_TYPE_CORRECTED][NVML_AGGREGATE_ECC] =
        uint_or(jget(ecc, "corrected_aggregate"), 0);
    dev->ecc[NVML_MEMORY_ERROR_TYPE_UNCORRECTED][NVML_VOLATILE_ECC] =
        uint_or(jget(ecc, "uncorrected_volatile"), 0);
    dev->ecc[NVML_MEMORY_ERROR_TYPE_UNCORRECTED][NVML_AGGREGATE_ECC] =
        uint_or(jget(ecc, "uncorrected_aggregate"), 0);

    const jval *util = jget(d, "utilization");
    dev->util_supported = !(util && util->type == J_NULL);
    dev->util_gpu = (unsigned)uint_or(jget(util, "gpu"), 0);
    dev->util_memory = (unsigned)uint_or(jget(util, "memory"), 0);
    if (dev->util_gpu > 100 || dev->util_memory > 100) {
        snprintf(error, error_size, "devices[%d].utilization is a percentage, 0 to 100", index);
        return 0;
    }

    const jval *temperature = jget(d, "temperature");
    dev->temperature_supported = !(temperature && temperature->type == J_NULL);
    dev->temperature = temperature && temperature->type == J_NUM ? (int)temperature->num : 33;

    const jval *power = jget(d, "power_usage");
    dev->power_supported = !(power && power->type == J_NULL);
    dev->power_mw = (unsigned)uint_or(power, 61000);

    dev->xid_supported = bool_or(jget(d, "xid_events_supported"), 1);
    const jval *xids = jget(d, "xids");
    if (xids && xids->type == J_ARR) {
        for (size_t i = 0; i < xids->n && i < MAX_XIDS; i++)
            dev->xids[dev->xid_count++] = uint_or(xids->items[i], 999);
    }
    if (!load_xid_events(dev, index, jget(d, "xid_events"), error, error_size)) return 0;

    const jval *errors = jget(d, "errors");
    if (errors && errors->type == J_OBJ) {
        for (size_t i = 0; i < errors->n && i < MAX_FAULTS; i++) {
            const jval *code = errors->items[i];
            if (code->type != J_STR || !code_by_name(code->str, &dev->fault_code[dev->fault_count])) {
                snprintf(error, error_size, "devices[%d].errors.%s is not an NVML_ERROR_* name",
                         index, errors->keys[i]);
                return 0;
            }
            snprintf(dev->fault_fn[dev->fault_count], sizeof dev->fault_fn[0], "%s",
                     errors->keys[i]);
            dev->fault_count++;
        }
    }
    dev->nvlink_group = dev->pcie_switch = dev->host_bridge = dev->numa_node = -1;
    return 1;
}

/* Reads the description at `path` into g_next_* and the version of the file read into `seen`; on
 * failure says why on stderr and returns the code init must fail with. */
static nvmlReturn_t read_node(const char *path, struct stat *seen) {
    g_next_device_count = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        complain(path, strerror(errno));
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    if (fstat(fileno(f), seen) != 0) memset(seen, 0, sizeof *seen);
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    while (text) {
        len += fread(text + len, 1, cap - len, f);
        if (len < cap) break;
        char *bigger = realloc(text, cap *= 2);
        if (!bigger) free(text);
        text = bigger;
    }
    fclose(f);
    if (!text) {
        complain(path, "out of memory");
        return NVML_ERROR_MEMORY;
    }
    jparser ps = {text, text + len, {0}};
    jval *root = jparse_value(&ps, 0);
    jskip_ws(&ps);
    if (root && ps.p != ps.end) {
        jfree(root);
        root = NULL;
        snprintf(ps.error, sizeof ps.error, "text after the description");
    }
    free(text);
    if (!root || root->type != J_OBJ) {
        char what[220];
        snprintf(what, sizeof what, "not a JSON object: %s", ps.error[0] ? ps.error : "wrong type");
        complain(path, what);
        jfree(root);
        return NVML_ERROR_UNKNOWN;
    }

    nvmlReturn_t result = NVML_SUCCESS;
    char error[160] = {0};
    const jval *init_error = jget(root, "init_error");
    if (init_error && init_error->type == J_STR) {
        if (!code_by_name(init_error->str, &result)) {
            snprintf(error, sizeof error, "init_error is not an NVML_ERROR_* name");
            result = NVML_ERROR_UNKNOWN;
        }
        goto done;
    }
    copy_string(g_next_driver_version, sizeof g_next_driver_version, jget(root, "driver_version"),
                "550.54.15");
    g_next_cuda_version = (int)uint_or(jget(root, "cuda_driver_version"), 12040);
    const jval *devices = jget(root, "devices");
    if (!devices || devices->type != J_ARR || devices->n > MAX_DEVICES) {
        snprintf(error, sizeof error, "devices must be a list of at most %d objects", MAX_DEVICES);
        result = NVML_ERROR_UNKNOWN;
        goto done;
    }
    for (size_t i = 0; i < devices->n; i++) {
        if (!load_device((int)i, devices->items[i], error, sizeof error)) {
            result = NVML_ERROR_UNKNOWN;
            goto done;
        }
    }
    g_next_device_count = (int)devices->n;
    const jval *topology = jget(root, "topology");
    if (!load_groups(jget(topology, "nvlink_groups"), offsetof(standin_device, nvlink_group),
                     error, sizeof error, "nvlink_groups") ||
        !load_groups(jget(topology, "pcie_switches"), offsetof(standin_device, pcie_switch), error,
                     sizeof error, "pcie_switches") ||
        !load_groups(jget(topology, "host_bridges"), offsetof(standin_device, host_bridge), error,
                     sizeof error, "host_bridges") ||
        !load_groups(jget(topology, "numa_nodes"), offsetof(standin_device, numa_node), error,
                     sizeof error, "numa_nodes")) {
        result = NVML_ERROR_UNKNOWN;
    }
done:
    if (result != NVML_SUCCESS) {
        g_next_device_count = 0;
        if (error[0]) complain(path, error);
    }
    jfree(root);
    return result;
}

/* The description just read becomes what the cards answer. */
static void commit_node(void) {
    memcpy(g_driver_version, g_next_driver_version, sizeof g_driver_version);
    g_cuda_version = g_next_cuda_version;
    g_device_count = g_next_device_count;
    memcpy(g_devices, g_next_devices, sizeof g_devices[0] * (size_t)g_next_device_count);
}

/* At the first nvmlInit: reads the description the environment names (see load_node's caller). */
static nvmlReturn_t load_node(void) {
    const char *path = getenv("LEVERS9_NVML_STANDIN");
    g_device_count = 0;
    g_path[0] = '\0';
    if (!path || !*path) {
        complain(NULL, "no node description, so this stand-in acts as a node without a driver");
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    if (strlen(path) >= sizeof g_path) {
        complain(path, "the path of the description is too long");
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    nvmlReturn_t result = read_node(path, &g_loaded);
    if (result != NVML_SUCCESS) return result;
    snprintf(g_path, sizeof g_path, "%s", path);
    commit_node();
    for (int i = 0; i < MAX_DEVICES; i++) { /* fixed, so handles stay valid across re-reads */
        g_handles[i].index = i;
        g_handles[i].mig_slot = -1;
        for (int m = 0; m < MAX_MIG; m++) {
            g_mig_handles[i][m].index = i;
            g_mig_handles[i][m].mig_slot = m;
        }
    }
    return NVML_SUCCESS;
}

static void queue_event(struct nvmlEventSet_st *set, int device, unsigned long long xid) {
    if (set->count >= MAX_EVENTS) return; /* a real driver drops events nobody reads, too */
    int slot = (set->head + set->count) % MAX_EVENTS;
    set->queue[slot].device = device;
    set->queue[slot].xid = xid;
    set->count++;
}

/* Queues each xid_events entry not yet seen into every set registered for its card. */
static void deliver_xid_events(void) {
    for (struct nvmlEventSet_st *set = g_sets; set; set = set->next) {
        for (int d = 0; d < g_device_count; d++) {
            const standin_device *dev = &g_devices[d];
            if (!set->registered[d]) continue;
            for (int i = 0; i < dev->xid_event_count; i++) {
                if (dev->xid_event_id[i] <= set->taken[d]) continue;
                queue_event(set, d, dev->xid_event_xid[i]);
                set->taken[d] = dev->xid_event_id[i];
            }
        }
    }
}

static int same_version(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* Under g_lock, in a session: if the description changed since it was read, reads it again; the
 * cards answer from it and its new XID events are queued. One that does not parse is ignored
 * (read_node said why), and so is one with an init_error: the session is already open. */
static void refresh_node(void) {
    struct stat now;
    if (!g_path[0] || stat(g_path, &now) != 0 || same_version(&now, &g_loaded)) return;
    g_loaded = now; /* read_node replaces it with the version it opened, in case that is newer */
    if (read_node(g_path, &g_loaded) != NVML_SUCCESS) return;
    commit_node();
    deliver_xid_events();
}

/* ---------------------------------------------------------------------------------------------- */
/* Checks shared by the device functions.                                                         */

static void release_lock(int *held) {
    if (*held) pthread_mutex_unlock(&g_lock);
}

/* Holds g_lock from here until the enclosing block ends (gcc's cleanup attribute). */
#define HOLD_LOCK(guard) \
    int guard __attribute__((cleanup(release_lock))) = (pthread_mutex_lock(&g_lock), 1)

/* Common entry of every call after nvmlInit: the lock held to the end of the call, a session
 * open, and the description read again if it changed. */
#define ENTER_SESSION(guard)                                                                       \
    HOLD_LOCK(guard);                                                                              \
    if (g_refcount == 0) return NVML_ERROR_UNINITIALIZED;                                          \
    refresh_node()

/* The card a handle stands for, or -1 if the handle is not one we handed out. */
static int handle_index(nvmlDevice_t device) {
    if (!device) return -1;
    int index = device->index;
    if (index < 0 || index >= g_device_count) return -1;
    if (device == &g_handles[index]) return index;
    if (device->mig_slot >= 0 && device->mig_slot < MAX_MIG &&
        device == &g_mig_handles[index][device->mig_slot])
        return index;
    return -1;
}

/* The code a test asked this function to fail with on this card, or NVML_SUCCESS. */
static nvmlReturn_t fault(int index, const char *function) {
    const standin_device *dev = &g_devices[index];
    for (int i = 0; i < dev->fault_count; i++) {
        if (strcmp(dev->fault_fn[i], function) == 0 || strcmp(dev->fault_fn[i], "*") == 0)
            return dev->fault_code[i];
    }
    return NVML_SUCCESS;
}

/* Common entry of every function taking a card: in a session (see ENTER_SESSION), handle valid,
 * no injected fault. */
#define ENTER_DEVICE(device, index_var, allow_mig)                                                 \
    ENTER_SESSION(held_##index_var);                                                               \
    int index_var = handle_index(device);                                                          \
    if (index_var < 0) return NVML_ERROR_INVALID_ARGUMENT;                                         \
    if (!(allow_mig) && (device)->mig_slot >= 0) return NVML_ERROR_NOT_SUPPORTED;                  \
    do {                                                                                           \
        nvmlReturn_t injected_ = fault(index_var, __func__);                                       \
        if (injected_ != NVML_SUCCESS) return injected_;                                           \
    } while (0)

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- */
/* Initialisation and system queries.                                                             */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t result = NVML_SUCCESS;
    if (g_refcount == 0) result = load_node();
    if (result == NVML_SUCCESS) g_refcount++;
    pthread_mutex_unlock(&g_lock);
    return result;
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t result = g_refcount > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_refcount > 0) g_refcount--;
    pthread_mutex_unlock(&g_lock);
    return result;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    for (size_t i = 0; i < sizeof RETURN_CODES / sizeof RETURN_CODES[0]; i++)
        if (RETURN_CODES[i].code == result) return RETURN_CODES[i].text;
    return "Unknown Error";
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER_SESSION(held);
    return copy_out(version, length, g_driver_version);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    ENTER_SESSION(held);
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = g_cuda_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    ENTER_SESSION(held);
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = (unsigned)g_device_count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER_SESSION(held);
    if (!device || index >= (unsigned)g_device_count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t injected = fault((int)index, __func__);
    if (injected != NVML_SUCCESS) return injected;
    *device = &g_handles[index];
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- */
/* Identity, memory, MIG.                                                                         */

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER_DEVICE(device, index, 1);
    if (device->mig_slot >= 0) {
        if (device->mig_slot >= g_devices[index].mig_count) return NVML_ERROR_INVALID_ARGUMENT;
        return copy_out(uuid, length, g_devices[index].mig_uuid[device->mig_slot]);
    }
    return copy_out(uuid, length, g_devices[index].uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER_DEVICE(device, index, 0);
    return copy_out(name, length, g_devices[index].name);
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    ENTER_DEVICE(device, index, 0);
    if (!minorNumber) return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = g_devices[index].minor;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER_DEVICE(device, index, 0);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    const standin_device *dev = &g_devices[index];
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT,
             dev->pci_domain & 0xFFFF, dev->pci_bus, dev->pci_device);
    snprintf(pci->busId, sizeof pci->busId, "%s", dev->pci_bus_id);
    pci->domain = dev->pci_domain;
    pci->bus = dev->pci_bus;
    pci->device = dev->pci_device;
    pci->pciDeviceId = dev->pci_device_id;
    return NVML_SUCCESS;
}

/* The unversioned call of drivers before the v2 struct; the facade falls back to it. */
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER_DEVICE(device, index, 0);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    const standin_device *dev = &g_devices[index];
    memory->total = dev->memory_total;
    memory->used = dev->memory_reserved + dev->memory_used; /* v1 counts reserved as used */
    memory->free = dev->memory_total - memory->used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER_DEVICE(device, index, 0);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    /* A caller built against another layout must be told, as the real library does. */
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    const standin_device *dev = &g_devices[index];
    memory->total = dev->memory_total;
    memory->reserved = dev->memory_reserved;
    memory->used = dev->memory_used;
    memory->free = dev->memory_total - dev->memory_reserved - dev->memory_used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                         unsigned int *pendingMode) {
    ENTER_DEVICE(device, index, 0);
    if (!currentMode || !pendingMode) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_devices[index].mig_supported) return NVML_ERROR_NOT_SUPPORTED;
    *currentMode = *pendingMode = g_devices[index].mig_mode;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER_DEVICE(device, index, 0);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_devices[index].mig_supported) return NVML_ERROR_NOT_SUPPORTED;
    *count = MAX_MIG - 1; /* seven slices, as on an A100 or H100 */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *migDevice) {
    ENTER_DEVICE(device, card, 0);
    if (!migDevice || index >= MAX_MIG - 1) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_devices[card].mig_supported || !g_devices[card].mig_mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)index >= g_devices[card].mig_count) return NVML_ERROR_NOT_FOUND;
    *migDevice = &g_mig_handles[card][index];
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- */
/* Processes and health.                                                                          */

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    ENTER_DEVICE(device, index, 0);
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    const standin_device *dev = &g_devices[index];
    unsigned have = (unsigned)dev->proc_count;
    if (*infoCount < have) {
        *infoCount = have;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (have > 0 && !infos) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < have; i++) {
        infos[i].pid = dev->proc_pid[i];
        infos[i].usedGpuMemory = dev->proc_memory[i];
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *infoCount = have;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                           nvmlEnableState_t *isPending) {
    ENTER_DEVICE(device, index, 0);
    if (!isPending) return NVML_ERROR_INVALID_ARGUMENT;
    if (g_devices[index].retired_pending < 0) return NVML_ERROR_NOT_SUPPORTED;
    *isPending = g_devices[index].retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                              unsigned int *uncRows, unsigned int *isPending,
                                              unsigned int *failureOccurred) {
    ENTER_DEVICE(device, index, 0);
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return NVML_ERROR_INVALID_ARGUMENT;
    const standin_device *dev = &g_devices[index];
    if (!dev->rows_supported) return NVML_ERROR_NOT_SUPPORTED;
    *corrRows = dev->rows_corrected;
    *uncRows = dev->rows_uncorrected;
    *isPending = dev->rows_pending;
    *failureOccurred = dev->rows_failure;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device,
                                                nvmlMemoryErrorType_t errorType,
                                                nvmlEccCounterType_t counterType,
                                                unsigned long long *eccCounts) {
    ENTER_DEVICE(device, index, 0);
    if (!eccCounts || (unsigned)errorType > 1 || (unsigned)counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_devices[index].ecc_supported) return NVML_ERROR_NOT_SUPPORTED;
    *eccCounts = g_devices[index].ecc[errorType][counterType];
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- */
/* What a card measures now: utilisation, temperature, power.                                     */

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                  nvmlUtilization_t *utilization) {
    ENTER_DEVICE(device, index, 0);
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_devices[index].util_supported) return NVML_ERROR_NOT_SUPPORTED;
    utilization->gpu = g_devices[index].util_gpu;
    utilization->memory = g_devices[index].util_memory;
    return NVML_SUCCESS;
}

/* The card's die sensor; the hottest-spot sensor (GPU_MAX) is not offered, as on older cards. */
static nvmlReturn_t read_temperature(int index, nvmlTemperatureSensors_t sensor, int *out) {
    if ((unsigned)sensor >= NVML_TEMPERATURE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_devices[index].temperature_supported || sensor != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_NOT_SUPPORTED;
    *out = g_devices[index].temperature;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device,
                                              nvmlTemperature_t *temperature) {
    ENTER_DEVICE(device, index, 0);
    if (!temperature) return NVML_ERROR_INVALID_ARGUMENT;
    if (temperature->version != nvmlTemperature_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    return read_temperature(index, temperature->sensorType, &temperature->temperature);
}

/* The unversioned call, deprecated in NVML 13 but what older drivers offer. */
EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                             nvmlTemperatureSensors_t sensorType,
                                             unsigned int *temp) {
    ENTER_DEVICE(device, index, 0);
    if (!temp) return NVML_ERROR_INVALID_ARGUMENT;
    int value;
    nvmlReturn_t result = read_temperature(index, sensorType, &value);
    if (result == NVML_SUCCESS) *temp = value < 0 ? 0u : (unsigned)value;
    return result;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    ENTER_DEVICE(device, index, 0);
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_devices[index].power_supported) return NVML_ERROR_NOT_SUPPORTED;
    *power = g_devices[index].power_mw;
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- */
/* Events: a registered card delivers its "xids" at registration, its new "xid_events" after.  */

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *eventTypes) {
    ENTER_DEVICE(device, index, 0);
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = g_devices[index].xid_supported ? (unsigned long long)nvmlEventTypeXidCriticalError
                                                 : 0ULL;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    ENTER_SESSION(held);
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    if (!*set) return NVML_ERROR_MEMORY;
    (*set)->next = g_sets;
    g_sets = *set;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set) {
    ENTER_DEVICE(device, index, 0);
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    const standin_device *dev = &g_devices[index];
    unsigned long long supported =
        dev->xid_supported ? (unsigned long long)nvmlEventTypeXidCriticalError : 0ULL;
    if (eventTypes & ~supported) return NVML_ERROR_NOT_SUPPORTED;
    if (!(eventTypes & nvmlEventTypeXidCriticalError)) return NVML_SUCCESS;
    for (int i = 0; i < dev->xid_count; i++) queue_event(set, index, dev->xids[i]);
    /* What happened before registering is not delivered; what is written from now on is. */
    set->registered[index] = 1;
    for (int i = 0; i < dev->xid_event_count; i++)
        if (dev->xid_event_id[i] > set->taken[index]) set->taken[index] = dev->xid_event_id[i];
    return NVML_SUCCESS;
}

/* The next queued event into `data`, or NVML_ERROR_TIMEOUT if there is none yet. */
static nvmlReturn_t take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    ENTER_SESSION(held);
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    if (set->count == 0) return NVML_ERROR_TIMEOUT;
    data->device = &g_handles[set->queue[set->head].device];
    data->eventType = nvmlEventTypeXidCriticalError;
    data->eventData = set->queue[set->head].xid;
    data->gpuInstanceId = 0xFFFFFFFFu;
    data->computeInstanceId = 0xFFFFFFFFu;
    set->head = (set->head + 1) % MAX_EVENTS;
    set->count--;
    return NVML_SUCCESS;
}

static long long monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* Waits, without the lock, looking every WAIT_POLL_MS for an event, so that one written to the
 * description mid-wait is delivered then and not at the end of the timeout. */
EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeoutms) {
    long long deadline = monotonic_ns() + (long long)timeoutms * 1000000LL;
    for (;;) {
        nvmlReturn_t result = take_event(set, data);
        long long left = deadline - monotonic_ns();
        if (result != NVML_ERROR_TIMEOUT || left <= 0) return result;
        long long step = left < WAIT_POLL_MS * 1000000LL ? left : WAIT_POLL_MS * 1000000LL;
        struct timespec pause = {(time_t)(step / 1000000000LL), (long)(step % 1000000000LL)};
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
        }
    }
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    ENTER_SESSION(held);
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    for (struct nvmlEventSet_st **link = &g_sets; *link; link = &(*link)->next) {
        if (*link == set) {
            *link = set->next;
            free(set);
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT; /* not a set this library handed out, or freed already */
}

/* ---------------------------------------------------------------------------------------------- */
/* Topology between two cards.                                                                    */

static int same_group(int a, int b) { return a >= 0 && a == b; }

EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                        nvmlGpuTopologyLevel_t *pathInfo) {
    ENTER_DEVICE(device1, a, 0);
    ENTER_DEVICE(device2, b, 0);
    if (!pathInfo) return NVML_ERROR_INVALID_ARGUMENT;
    const standin_device *x = &g_devices[a], *y = &g_devices[b];
    if (a == b) *pathInfo = NVML_TOPOLOGY_INTERNAL;
    else if (same_group(x->pcie_switch, y->pcie_switch)) *pathInfo = NVML_TOPOLOGY_SINGLE;
    else if (same_group(x->host_bridge, y->host_bridge)) *pathInfo = NVML_TOPOLOGY_HOSTBRIDGE;
    else if (same_group(x->numa_node, y->numa_node)) *pathInfo = NVML_TOPOLOGY_NODE;
    else *pathInfo = NVML_TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                           nvmlGpuP2PCapsIndex_t p2pIndex,
                                           nvmlGpuP2PStatus_t *p2pStatus) {
    ENTER_DEVICE(device1, a, 0);
    ENTER_DEVICE(device2, b, 0);
    if (!p2pStatus) return NVML_ERROR_INVALID_ARGUMENT;
    const standin_device *x = &g_devices[a], *y = &g_devices[b];
    if (p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK)
        *p2pStatus = same_group(x->nvlink_group, y->nvlink_group) ? NVML_P2P_STATUS_OK
                                                                  : NVML_P2P_STATUS_NOT_SUPPORTED;
    else
        *p2pStatus = same_group(x->numa_node, y->numa_node) || same_group(x->host_bridge, y->host_bridge)
                         ? NVML_P2P_STATUS_OK
                         : NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED;
    return NVML_SUCCESS;
}
