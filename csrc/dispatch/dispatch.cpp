// ISA detection and the current kernel table (see dispatch.hpp).
#include "dispatch/kernel_table.hpp"

#include <cstdlib>
#include <stdexcept>

namespace eb {
namespace isa_scalar {
extern const KernelTable kTable;
}
#ifdef EB_HAVE_AVX2
namespace isa_avx2 {
extern const KernelTable kTable;
}
#endif
#ifdef EB_HAVE_AVX512
namespace isa_avx512 {
extern const KernelTable kTable;
}
#endif
#ifdef EB_HAVE_NEON
namespace isa_neon {
extern const KernelTable kTable;
}
#endif

namespace {

std::vector<const KernelTable*> supported() {
  std::vector<const KernelTable*> out{&isa_scalar::kTable};
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
#ifdef EB_HAVE_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    out.push_back(&isa_avx2::kTable);
#endif
#ifdef EB_HAVE_AVX512
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    out.push_back(&isa_avx512::kTable);
#endif
#endif
#if defined(__aarch64__) && defined(EB_HAVE_NEON)
  out.push_back(&isa_neon::kTable);  // Advanced SIMD is mandatory in AArch64
#endif
  return out;
}

const KernelTable* find(const std::string& name) {
  for (const KernelTable* t : supported())
    if (name == t->name) return t;
  return nullptr;
}

const KernelTable* initial() {
  const char* env = std::getenv("EXACTBLOCKS_ISA");
  if (env && *env) {
    const KernelTable* t = find(env);
    if (t) return t;  // an unavailable request is reported by the Python layer at import
  }
  return supported().back();
}

const KernelTable* g_current = initial();

}  // namespace

const KernelTable& kernels() { return *g_current; }

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (const KernelTable* t : supported()) out.emplace_back(t->name);
  return out;
}

void set_isa(const std::string& name) {
  const KernelTable* t = find(name);
  if (!t) throw std::invalid_argument("ISA '" + name + "' is not available on this CPU");
  g_current = t;
}

std::string get_isa() { return g_current->name; }

}  // namespace eb
