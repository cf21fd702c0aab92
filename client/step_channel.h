// liboptimd_step_channel.so's C interface (client/step_channel.cc): one
// session's StepStream on C++ threads, for the Python client's ctypes
// (optimd/_native_steps.py). A channel is used by one thread at a time.
#ifndef OPTIMD_CLIENT_STEP_CHANNEL_H_
#define OPTIMD_CLIENT_STEP_CHANNEL_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// A StepStream of the session `token` at `target` (a unix: address), or
// NULL with the reason in err when no daemon answers within
// connect_timeout_ms.
void* optimd_step_channel_open(const char* target, const char* token,
                               int connect_timeout_ms, char* err,
                               size_t err_cap);

// 0: the serialized StepRequest was queued for writing; -1: the stream
// takes no more (optimd_step_channel_next gives its end).
int optimd_step_channel_send(void* channel, const void* data, size_t len);

// 1: the next reply, serialized, in buf (*len its size; -2 and *len the
// size needed when cap is too small: the reply is kept for the next call);
// 0: none came within timeout_ms (0: no wait; negative: wait for one);
// -1: the stream ended, *code its gRPC status code (0: the daemon ended it
// cleanly) and buf its message.
int optimd_step_channel_next(void* channel, int timeout_ms, char* buf,
                             size_t cap, size_t* len, int* code);

// 1 once a reply is queued or the stream has ended (until_end != 0: once
// it has ended), 0 if not within timeout_ms; takes nothing.
int optimd_step_channel_wait(void* channel, int timeout_ms, int until_end);

// Ends the requests (after those queued are written); the daemon answers
// them and ends the stream. Returns at once.
void optimd_step_channel_end_writes(void* channel);

// Ends the requests and waits until the daemon has answered those sent and
// ended the stream (cancelled after timeout_ms); the replies stay for
// optimd_step_channel_next.
void optimd_step_channel_finish(void* channel, int timeout_ms);

// Frees a channel (one still open is cancelled first).
void optimd_step_channel_free(void* channel);

#ifdef __cplusplus
}
#endif

#endif  // OPTIMD_CLIENT_STEP_CHANNEL_H_
