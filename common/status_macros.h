// Status propagation macros. Abseil 20220623 ships no ABSL_RETURN_IF_ERROR,
// so the project keeps its own two here, and nowhere else.
#ifndef OPTIMD_COMMON_STATUS_MACROS_H_
#define OPTIMD_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define OPTIMD_STATUS_CONCAT_INNER_(a, b) a##b
#define OPTIMD_STATUS_CONCAT_(a, b) OPTIMD_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` yields a non-OK status.
#define OPTIMD_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status optimd_status_ = (expr);          \
    if (!optimd_status_.ok()) return optimd_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status,
// otherwise moves the value into `lhs` (which may be a declaration).
#define OPTIMD_ASSIGN_OR_RETURN(lhs, rexpr) \
  OPTIMD_ASSIGN_OR_RETURN_IMPL_(            \
      OPTIMD_STATUS_CONCAT_(optimd_statusor_, __LINE__), lhs, rexpr)

#define OPTIMD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return statusor.status();             \
  lhs = std::move(statusor).value()

#endif  // OPTIMD_COMMON_STATUS_MACROS_H_
