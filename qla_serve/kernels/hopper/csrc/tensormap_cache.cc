// A memo in front of TileLang's TMA descriptor encoder (host side), for host_cache.py.
//
// TileLang's generated host function for a kernel with TMA loads encodes every tensor map
// (cuTensorMapEncodeTiled, 128 bytes each) on every launch, through the global tvm-ffi function
// "__tvm_tensormap_create_tiled". A tensor map is a pure function of the encoder's arguments
// (data type, rank, global address, dims, strides, box, element strides, interleave, swizzle,
// L2 promotion, OOB fill): no device state enters it. So the bytes the encoder wrote for one
// argument list are the bytes it would write again, and a later call with the same list can
// copy them instead. In a serving step every GDN layer's prefill hands the kernels the same
// step buffers, so after the step's first layer every encode is such a repeat.
//
// qla_tensormap_cache_install(name) replaces the global function `name` by a wrapper that
// looks its arguments up here; a miss forwards the call to the function it replaced (TileLang's
// argument checks and the encode, errors included) and keeps the result only when that call
// succeeded. The memo holds at most kMaxEntries maps and starts over when full.
//
// Only the tvm-ffi C API is used (c_api.h), so this compiles against the headers of the
// apache-tvm-ffi wheel with any C++17 compiler; nothing here touches CUDA.

#include <tvm/ffi/c_api.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

constexpr int kMapBytes = 128;          // sizeof(CUtensorMap)
constexpr int kMaxArgs = 32;            // the encoder takes 8 + 4 x rank (rank <= 5) arguments
constexpr size_t kMaxEntries = 4096;

struct Key {
  int32_t n = 0;
  int32_t type_index[kMaxArgs];
  int64_t value[kMaxArgs];
  bool operator==(const Key& o) const {
    return n == o.n && std::memcmp(type_index, o.type_index, n * sizeof(int32_t)) == 0 &&
           std::memcmp(value, o.value, n * sizeof(int64_t)) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the payloads
    for (int i = 0; i < k.n; ++i) {
      h = (h ^ static_cast<uint64_t>(k.value[i])) * 1099511628211ull;
      h = (h ^ static_cast<uint64_t>(k.type_index[i])) * 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

struct Map {
  unsigned char bytes[kMapBytes];
};

struct Memo {
  TVMFFIObjectHandle original = nullptr;  // the encoder this wraps (one reference held)
  std::mutex mutex;
  std::unordered_map<Key, Map, KeyHash> maps;
  int64_t hits = 0, misses = 0;
  bool enabled = true;
};

// One memo per wrapped name; never freed (the wrapped functions live as long as the process).
std::mutex g_registry_mutex;
std::unordered_map<std::string, Memo*> g_memos;

int Encode(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  Memo* memo = static_cast<Memo*>(self);
  // Argument 0 is where the map goes; the rest describe it.
  bool keyed = memo->enabled && num_args >= 1 && num_args - 1 <= kMaxArgs &&
               args[0].type_index == kTVMFFIOpaquePtr && args[0].v_ptr != nullptr;
  Key key;
  if (keyed) {
    key.n = num_args - 1;
    for (int i = 1; i < num_args; ++i) {
      int32_t t = args[i].type_index;
      // Only plain values describe a map; anything else (an object) is not keyed by value.
      if (t != kTVMFFINone && t != kTVMFFIInt && t != kTVMFFIBool && t != kTVMFFIOpaquePtr) {
        keyed = false;
        break;
      }
      key.type_index[i - 1] = t;
      key.value[i - 1] = args[i].v_int64;
    }
  }
  if (keyed) {
    std::lock_guard<std::mutex> lock(memo->mutex);
    auto it = memo->maps.find(key);
    if (it != memo->maps.end()) {
      std::memcpy(args[0].v_ptr, it->second.bytes, kMapBytes);
      ++memo->hits;
      result->type_index = kTVMFFIInt;
      result->zero_padding = 0;
      result->v_int64 = 0;  // CUDA_SUCCESS, as the encoder returns
      return 0;
    }
    ++memo->misses;
  }
  int rc = TVMFFIFunctionCall(memo->original, const_cast<TVMFFIAny*>(args), num_args, result);
  if (rc == 0 && keyed && result->type_index == kTVMFFIInt && result->v_int64 == 0) {
    std::lock_guard<std::mutex> lock(memo->mutex);
    if (memo->maps.size() >= kMaxEntries) memo->maps.clear();
    Map m;
    std::memcpy(m.bytes, args[0].v_ptr, kMapBytes);
    memo->maps.emplace(key, m);
  }
  return rc;
}

Memo* Find(const char* name) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = g_memos.find(name);
  return it == g_memos.end() ? nullptr : it->second;
}

}  // namespace

extern "C" {

// Wrap the global function `name`. Returns 0 once installed, 1 when it already was, -1 when no
// such global exists, -2 when tvm-ffi refused to create or register the wrapper.
int qla_tensormap_cache_install(const char* name) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (g_memos.count(name)) return 1;
  TVMFFIByteArray fname{name, std::strlen(name)};
  TVMFFIObjectHandle original = nullptr;
  if (TVMFFIFunctionGetGlobal(&fname, &original) != 0 || original == nullptr) return -1;
  Memo* memo = new Memo();
  memo->original = original;
  TVMFFIObjectHandle wrapper = nullptr;
  if (TVMFFIFunctionCreate(memo, Encode, nullptr, &wrapper) != 0 ||
      TVMFFIFunctionSetGlobal(&fname, wrapper, /*allow_override=*/1) != 0) {
    TVMFFIObjectDecRef(original);
    delete memo;
    return -2;
  }
  TVMFFIObjectDecRef(wrapper);  // the global table holds it now
  g_memos[name] = memo;
  return 0;
}

// Hits and misses so far (keyed calls only); -1 when `name` is not wrapped.
int qla_tensormap_cache_stats(const char* name, int64_t* hits, int64_t* misses, int64_t* entries) {
  Memo* memo = Find(name);
  if (memo == nullptr) return -1;
  std::lock_guard<std::mutex> lock(memo->mutex);
  *hits = memo->hits;
  *misses = memo->misses;
  *entries = static_cast<int64_t>(memo->maps.size());
  return 0;
}

// Turn the memo off (every call encodes, as without the wrapper) or on again; off also empties
// it. For A/B measurements and tests.
int qla_tensormap_cache_enable(const char* name, int on) {
  Memo* memo = Find(name);
  if (memo == nullptr) return -1;
  std::lock_guard<std::mutex> lock(memo->mutex);
  memo->enabled = on != 0;
  if (!memo->enabled) memo->maps.clear();
  return 0;
}

}  // extern "C"
