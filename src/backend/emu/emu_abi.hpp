// The binary interface between the emulation runtime and a kernel module built by the host JIT:
// plain C structs and function-pointer tables. They are written once, in the macro below; the
// runtime compiles them and the JIT writes the same text into the module's include folder
// (kg_emu_abi.h), so the two sides cannot drift apart.
#pragma once

#define KG_EMU_ABI_VERSION 2

// clang-format off
#define KG_EMU_ABI(X)                                                                               \
  X(                                                                                                \
  struct KgEmuDim3 { unsigned x, y, z; };                                                           \
  /* One emulated thread, owned by the runtime; the module copies it into its thread-locals. */    \
  struct KgEmuThreadInfo {                                                                          \
    struct KgEmuDim3 thread_idx, block_idx, block_dim, grid_dim;                                    \
    unsigned char* dynamic_shared;                                                                  \
    void* runtime;                                                                                  \
    int checked;                                                                                    \
  };                                                                                                \
  enum KgEmuWarpOp {                                                                                \
    KG_EMU_SHFL_IDX = 0, KG_EMU_SHFL_UP = 1, KG_EMU_SHFL_DOWN = 2, KG_EMU_SHFL_XOR = 3,             \
    KG_EMU_VOTE_ALL = 4, KG_EMU_VOTE_ANY = 5, KG_EMU_VOTE_BALLOT = 6, KG_EMU_SYNCWARP = 7,           \
    KG_EMU_MATCH_ANY = 8, KG_EMU_MATCH_ALL = 9, KG_EMU_REDUCE_ADD = 10, KG_EMU_REDUCE_MIN_S = 11,    \
    KG_EMU_REDUCE_MIN_U = 12, KG_EMU_REDUCE_MAX_S = 13, KG_EMU_REDUCE_MAX_U = 14,                    \
    KG_EMU_REDUCE_AND = 15, KG_EMU_REDUCE_OR = 16, KG_EMU_REDUCE_XOR = 17                            \
  };                                                                                                \
  enum KgEmuBarrierOp { KG_EMU_BAR_SYNC = 0, KG_EMU_BAR_COUNT = 1, KG_EMU_BAR_AND = 2, KG_EMU_BAR_OR = 3 }; \
  /* What the runtime offers a module. Every call that can block switches fibers. */               \
  struct KgEmuApi {                                                                                 \
    int version;                                                                                    \
    int (*barrier)(const struct KgEmuThreadInfo* self, int op, int predicate);                      \
    unsigned long long (*warp)(const struct KgEmuThreadInfo* self, int op, unsigned mask,           \
                               unsigned long long value, int arg, int width);                       \
    unsigned (*active_mask)(const struct KgEmuThreadInfo* self);                                   \
    void (*note_atomic)(const struct KgEmuThreadInfo* self, const void* address);                  \
    void (*trap)(const struct KgEmuThreadInfo* self, const char* what);                            \
    /* A load or store through a pointer not aligned for its type; does not return. `store`: 1 a */  \
    /* store, 0 a load, -1 another access; `type` as the compiler names it; file and line of the */  \
    /* kernel source (the JIT's #line).                                                          */  \
    void (*misaligned)(const struct KgEmuThreadInfo* self, const void* address, unsigned alignment, \
                       int store, const char* type, const char* file, unsigned line);               \
  };                                                                                                \
  /* A kernel parameter's C++ type, as the module's compiler sees it. */                            \
  enum KgEmuTypeKind {                                                                              \
    KG_EMU_OTHER = 0, KG_EMU_POINTER = 1, KG_EMU_SIGNED = 2, KG_EMU_UNSIGNED = 3,                   \
    KG_EMU_FLOAT = 4, KG_EMU_HALF = 5, KG_EMU_BF16 = 6                                              \
  };                                                                                                \
  struct KgEmuParam {                                                                               \
    unsigned size;          /* sizeof the parameter */                                              \
    int kind;               /* KgEmuTypeKind */                                                     \
    unsigned pointee_size;  /* pointers: sizeof the element (1 for void) */                         \
    int pointee_kind;       /* pointers: KgEmuTypeKind of the element */                            \
    int pointee_const;      /* pointers: the element is const */                                    \
  };                                                                                                \
  )
// clang-format on

#define KG_EMU_ABI_EXPAND(...) __VA_ARGS__
#define KG_EMU_ABI_TEXT(...) #__VA_ARGS__

KG_EMU_ABI(KG_EMU_ABI_EXPAND)
