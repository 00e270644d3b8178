/*
 * A framework library linked against a libcupti of its own: another
 * toolkit's copy (say CUDA 12's libcupti.so.12 in a process whose CUDA 13
 * tools loaded libcupti.so.13), which the dynamic linker binds its calls to
 * through its PLT and GOT when it is loaded. It exports fw_<name> for each
 * CUPTI function the rival profiler of cuda_workload.c calls
 * ($DEVTRACE_STANDIN_RIVAL_FRAMEWORK), each calling <name> of that copy.
 *
 * Build (tests/it/cuda.rs does): cc -shared -fPIC -o libother_toolkit_framework.so
 *   cupti_framework.c OTHER_COPY_OF_LIBCUPTI -Wl,-rpath,ITS_DIRECTORY
 */
#include <stddef.h>
#include <stdint.h>

typedef void (*RequestFunc)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*CompleteFunc)(void *context, uint32_t stream, uint8_t *buffer, size_t size, size_t valid);
typedef void (*CallbackFunc)(void *userdata, int domain, uint32_t cbid, const void *data);

int cuptiActivityRegisterCallbacks(RequestFunc requested, CompleteFunc completed);
int cuptiActivityEnable(int kind);
int cuptiActivityDisable(int kind);
int cuptiActivityFlushAll(uint32_t flag);
int cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, void **record);
int cuptiSubscribe(void **subscriber, CallbackFunc callback, void *userdata);
int cuptiUnsubscribe(void *subscriber);
int cuptiFinalize(void);

int fw_cuptiActivityRegisterCallbacks(RequestFunc requested, CompleteFunc completed) {
    return cuptiActivityRegisterCallbacks(requested, completed);
}
int fw_cuptiActivityEnable(int kind) { return cuptiActivityEnable(kind); }
int fw_cuptiActivityDisable(int kind) { return cuptiActivityDisable(kind); }
int fw_cuptiActivityFlushAll(uint32_t flag) { return cuptiActivityFlushAll(flag); }
int fw_cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, void **record) {
    return cuptiActivityGetNextRecord(buffer, valid, record);
}
int fw_cuptiSubscribe(void **subscriber, CallbackFunc callback, void *userdata) {
    return cuptiSubscribe(subscriber, callback, userdata);
}
int fw_cuptiUnsubscribe(void *subscriber) { return cuptiUnsubscribe(subscriber); }
int fw_cuptiFinalize(void) { return cuptiFinalize(); }
