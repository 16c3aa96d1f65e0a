// The dspark_ops operator library: every schema (schemas.h), defined once. Backends register their
// kernels with TORCH_LIBRARY_IMPL in cpu/<family>_cpu.cpp and cuda/<family>_cuda.cpp; fake (meta)
// kernels for torch.compile live in dspark_ops/ops/<family>.py.
#include <torch/library.h>

#include <cstddef>
#include <iterator>

#include "schemas.h"

TORCH_LIBRARY(dspark_ops, m) {
  for (const char* schema : dspark_ops::kSchemas) m.def(schema, {at::Tag::pt2_compliant_tag});
}

// The schemas in the order of schemas.h, for dspark_ops._library (ctypes): the Python package
// takes its list of ops from the library it loaded, not from a copy of its own. The dispatcher
// knows the ops too, but not in this order.
extern "C" C10_EXPORT const char* const* dspark_ops_schemas(size_t* count) {
  *count = std::size(dspark_ops::kSchemas);
  return dspark_ops::kSchemas;
}
