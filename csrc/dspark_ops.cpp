// The dspark_ops operator library: every schema (schemas.h), defined once. Backends register their
// kernels with TORCH_LIBRARY_IMPL in cpu/<family>_cpu.cpp and cuda/<family>_cuda.cu; fake (meta)
// kernels for torch.compile live in dspark_ops/ops/<family>.py.
#include <torch/library.h>

#include "schemas.h"

TORCH_LIBRARY(dspark_ops, m) {
  for (const char* schema : dspark_ops::kSchemas) m.def(schema, {at::Tag::pt2_compliant_tag});
}
