// SessionAttachment: what a layer above the domain model keeps per session
// (checkpoint/'s background save) without the session knowing its type.
//
// A session holds one attachment of each type (Session::Attachment) for as
// long as it lives and destroys them before anything else of its own, so
// that work an attachment runs (a thread writing the session's snapshot)
// ends before the session's state is freed. Thread safety is each
// attachment's own.
#ifndef OPTIMD_CORE_SESSION_ATTACHMENT_H_
#define OPTIMD_CORE_SESSION_ATTACHMENT_H_

namespace optimd {

class SessionAttachment {
 public:
  SessionAttachment() = default;
  SessionAttachment(const SessionAttachment&) = delete;
  SessionAttachment& operator=(const SessionAttachment&) = delete;
  virtual ~SessionAttachment() = default;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_SESSION_ATTACHMENT_H_
