/*
 * segv_in_run.c - the elementwise example backend under the id "segv-c", whose run()
 * dereferences NULL when the first input element is -1 (a native plugin that crashes
 * on some input: issue 30). Compiled by tests/e2e/test_workers.py with
 * -I examples/backends/elementwise.
 */
#define inferd_backend_get elementwise_backend_get
#define inferd_backend_api_version elementwise_backend_api_version
#include "elementwise_backend.c"
#undef inferd_backend_get
#undef inferd_backend_api_version

static const char *segv_id(void) { return "segv-c"; }

static int32_t segv_run(inferd_model *m, const inferd_tensor *inputs, size_t n_inputs,
                        inferd_tensor **outputs, size_t *n_outputs)
{
    if (n_inputs == 1 && inputs[0].nbytes >= sizeof(float)
        && ((const float *)inputs[0].data)[0] == -1.0f) {
        volatile int *nowhere = NULL;
        *nowhere = 1;
    }
    return run(m, inputs, n_inputs, outputs, n_outputs);
}

static inferd_backend segv_table;

INFERD_BACKEND_EXPORT uint32_t inferd_backend_api_version(void)
{
    return INFERD_BACKEND_API_VERSION;
}

INFERD_BACKEND_EXPORT const inferd_backend *inferd_backend_get(void)
{
    segv_table = table;
    segv_table.id = segv_id;
    segv_table.run = segv_run;
    return &segv_table;
}
