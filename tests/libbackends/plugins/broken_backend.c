/*
 * broken_backend.c - a minimal native backend, compiled by the tests with -D flags
 * that break it in one way each:
 *   PLUGIN_ID="x"           the id it reports (default "broken")
 *   PLUGIN_KIND=n           its INFERD_KIND_* (default CPU)
 *   API_VERSION_VALUE=v     what inferd_backend_api_version() returns
 *   NO_GETTER               inferd_backend_get is not exported
 *   SEGV_IN_GETTER          inferd_backend_get() dereferences NULL
 *   HANG_IN_PROBE           probe() never returns
 *   ABORT_IN_PROBE          probe() calls abort()
 *   UNAVAILABLE             probe() says its device is absent
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "inferd_backend.h"

#ifndef PLUGIN_ID
#define PLUGIN_ID "broken"
#endif
#ifndef PLUGIN_KIND
#define PLUGIN_KIND INFERD_KIND_CPU
#endif
#ifndef API_VERSION_VALUE
#define API_VERSION_VALUE INFERD_BACKEND_API_VERSION
#endif

static _Thread_local char err[256];

static const char *id(void) { return PLUGIN_ID; }
static const char *version(void) { return "0.0.1"; }
static int32_t device_kind(void) { return PLUGIN_KIND; }

static int32_t probe(char *devices, size_t len)
{
#ifdef HANG_IN_PROBE
    for (;;)
        pause();
#endif
#ifdef ABORT_IN_PROBE
    abort();
#endif
#ifdef UNAVAILABLE
    (void)devices;
    (void)len;
    snprintf(err, sizeof err, "no device node /dev/fake-npu0");
    return 0;
#else
    snprintf(devices, len, "fake0");
    return 1;
#endif
}

static int32_t supports(const char *path)
{
    snprintf(err, sizeof err, "this test plugin runs nothing (%s)", path);
    return 0;
}

static int32_t load(const char *path, int32_t threads, inferd_model **out)
{
    (void)threads;
    (void)out;
    snprintf(err, sizeof err, "this test plugin cannot load %s", path);
    return INFERD_ERR_UNSUPPORTED;
}

static int32_t describe(const inferd_model *m, int32_t o, const inferd_tensor **t, size_t *n)
{
    (void)m; (void)o; (void)t; (void)n;
    return INFERD_ERR_INTERNAL;
}

static int32_t run(inferd_model *m, const inferd_tensor *i, size_t ni, inferd_tensor **o,
                   size_t *no)
{
    (void)m; (void)i; (void)ni; (void)o; (void)no;
    return INFERD_ERR_INTERNAL;
}

static void free_outputs(inferd_tensor *o, size_t n) { (void)o; (void)n; }
static void unload(inferd_model *m) { (void)m; }
static const char *last_error(void) { return err; }

__attribute__((unused)) static const inferd_backend table = {
    sizeof(inferd_backend), id, version, device_kind, probe, supports, load, describe,
    run, free_outputs, unload, last_error,
};

INFERD_BACKEND_EXPORT uint32_t inferd_backend_api_version(void) { return API_VERSION_VALUE; }

#ifndef NO_GETTER
INFERD_BACKEND_EXPORT const inferd_backend *inferd_backend_get(void)
{
#ifdef SEGV_IN_GETTER
    volatile int *nowhere = NULL;
    *nowhere = 1;
#endif
    return &table;
}
#endif
