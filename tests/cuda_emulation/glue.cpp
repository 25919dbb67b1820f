// CPU emulation (tests only): the parts of the emulator that live in one translation unit
// (the fiber switch, the fault and timeout handler) and what the Python stand-in for
// fgd_fast._C needs besides the kernels' own extern "C" launch functions: the numbers of
// fgd_cuda.h (as the binding's constants() exports them), fenced memory, the emulator's
// error message, settings and statistics, the 16-bit conversions (checked against torch) and
// the emulator's self-test kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <signal.h>
#include <unistd.h>

#include <string>

#include "fgd_cuda.h"

// ---- the emulator's fiber switch (emu.h): save the callee-saved registers and the
// floating-point control state on the current stack, store the stack pointer in *save_sp,
// load to_sp and restore the same from there. emu::make_fiber builds a first frame by hand.
#if FGD_EMU_ASM_SWITCH && defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .globl fgd_emu_switch
    .hidden fgd_emu_switch
    .type fgd_emu_switch, @function
fgd_emu_switch:
    endbr64
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fgd_emu_switch, .-fgd_emu_switch
)");
#elif FGD_EMU_ASM_SWITCH && defined(__aarch64__)
asm(R"(
    .text
    .p2align 4
    .globl fgd_emu_switch
    .hidden fgd_emu_switch
    .type fgd_emu_switch, %function
fgd_emu_switch:
    hint #34
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mrs x9, fpcr
    str x9, [sp, #160]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldr x9, [sp, #160]
    msr fpcr, x9
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size fgd_emu_switch, .-fgd_emu_switch
)");
#endif

// ---- faults inside a kernel: a memory fault (a read or write past the end of a fenced
// buffer, or any bad address) or the watchdog's SIGXCPU (emu.h) while a kernel's thread
// runs abandons that thread, and the launch fails with cudaErrorIllegalAddress or
// cudaErrorLaunchTimeout and a message naming the kernel, block and thread. A memory fault
// anywhere else goes on to the previous handler (Python's faulthandler, which prints the
// traceback; the stand-in calls with the GIL held for that). Async-signal-safe.

namespace {

struct sigaction previous_segv, previous_bus;

struct Writer {
    char* p;
    char* end;
    void put(const char* s) {
        while (*s && p < end - 1) *p++ = *s++;
        *p = 0;
    }
    void number(unsigned long long v, int base = 10) {
        char buf[24];
        int i = 23;
        buf[i] = 0;
        do buf[--i] = "0123456789abcdef"[v % base]; while (v /= base);
        put(buf + i);
    }
};

uintptr_t interrupted_sp(void* context) {
    const auto* uc = static_cast<const ucontext_t*>(context);
#if defined(__x86_64__)
    return (uintptr_t)uc->uc_mcontext.gregs[REG_RSP];
#elif defined(__aarch64__)
    return (uintptr_t)uc->uc_mcontext.sp;
#else
    (void)uc;
    return 0;  // unknown: trust emu::in_fiber alone
#endif
}

void on_signal(int sig, siginfo_t* info, void* context) {
    const uintptr_t sp = interrupted_sp(context);
    if (emu::running_since.load() != 0 && (sp ? emu::on_fiber_stack(sp) : (bool)emu::in_fiber)) {
        Writer w{emu::fault_message, emu::fault_message + sizeof emu::fault_message};
        if (sig == SIGXCPU) {
            emu::fault_code = cudaErrorLaunchTimeout;
            w.put("emulator: launch timed out (an endless loop?) in ");
        } else {
            emu::fault_code = cudaErrorIllegalAddress;
            w.put("emulator: illegal address 0x");
            w.number((unsigned long long)(uintptr_t)info->si_addr, 16);
            w.put(sig == SIGSEGV ? " (segmentation fault) in " : " (bus error) in ");
        }
        w.put(emu::running_kernel.load());
        w.put(", block (");
        w.number(blockIdx.x), w.put(", "), w.number(blockIdx.y), w.put(", "), w.number(blockIdx.z);
        w.put("), thread ");
        w.number(emu::current);
        emu::faulted = 1;
        emu::in_fiber = 0;
#if FGD_EMU_ASM_SWITCH
        if (!emu::use_ucontext) {
            void* abandoned;
            fgd_emu_switch(&abandoned, emu::scheduler_sp);  // back into run_block; never returns
        }
#endif
        setcontext(&emu::scheduler);
    }
    if (sig != SIGXCPU)  // not ours: the fault repeats under the previous handler
        sigaction(sig, sig == SIGSEGV ? &previous_segv : &previous_bus, nullptr);
}

const bool signal_handlers_installed = [] {
    struct sigaction sa = {};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
    sigaction(SIGBUS, &sa, &previous_bus);
    sigaction(SIGXCPU, &sa, nullptr);
    return true;
}();

}  // namespace

extern "C" {

// The binding's constants() as JSON (same keys; tests check them against fgd_binding.cpp).
const char* fgd_emu_constants_json() {
    static std::string json;
    if (json.empty()) {
        auto kv = [](const char* k, long long v) { return std::string("\"") + k + "\": " + std::to_string(v); };
        json = "{" + kv("META_FIELDS", FGD_META_FIELDS) + ", \"FIELDS\": {" + kv("THETA", FGD_M_THETA) + ", " +
               kv("PHI", FGD_M_PHI) + ", " + kv("GRAD", FGD_M_GRAD) + ", " + kv("N", FGD_M_N) + ", " +
               kv("P", FGD_M_P) + ", " + kv("THETA_SR", FGD_M_THETA_SR) + ", " + kv("THETA_SC", FGD_M_THETA_SC) +
               ", " + kv("PHI_SR", FGD_M_PHI_SR) + ", " + kv("PHI_SC", FGD_M_PHI_SC) + ", " +
               kv("GRAD_SR", FGD_M_GRAD_SR) + ", " + kv("GRAD_SC", FGD_M_GRAD_SC) + ", " + kv("FLAGS", FGD_M_FLAGS) +
               ", " + kv("GRAM_OFF", FGD_M_GRAM_OFF) + ", " + kv("M_OFF", FGD_M_M_OFF) + ", " +
               kv("FIRST_TILE", FGD_M_FIRST_TILE) + ", " + kv("FIRST_BLOCK", FGD_M_FIRST_BLOCK) + ", " +
               kv("CHUNK", FGD_M_CHUNK) + "}, \"SLOTS\": {" + kv("A", FGD_SLOT_A) + ", " + kv("E", FGD_SLOT_E) +
               ", " + kv("B", FGD_SLOT_B) + ", " + kv("C", FGD_SLOT_C) + ", " + kv("M_THETA", FGD_SLOT_M_THETA) + ", " +
               kv("M_PHI", FGD_SLOT_M_PHI) + "}, " + kv("GRAM_TILE", FGD_GRAM_TILE) + ", " + kv("GRAM_BK", FGD_GRAM_BK) +
               ", " + kv("UPD_ROWS", FGD_UPD_ROWS) + ", " + kv("F32", FGD_F32) + ", " + kv("F16", FGD_F16) + ", " +
               kv("BF16", FGD_BF16) + ", " + kv("F64", FGD_F64) + ", " + kv("READS_PHI", FGD_READS_PHI) + ", " +
               kv("WRITES_PHI", FGD_WRITES_PHI) + ", " + kv("SOURCE_HASH", FGD_SOURCE_HASH) + "}";
    }
    return json.c_str();
}

// Fenced memory: `nbytes` that end exactly where an inaccessible page begins, preceded by at
// least `front` accessible bytes (the caller's guard band). Returns the data address; the
// mapping is [*base, *base + *length).
void* fgd_emu_fenced_alloc(unsigned long long nbytes, unsigned long long front, unsigned long long* base,
                           unsigned long long* length) {
    const unsigned long long page = (unsigned long long)sysconf(_SC_PAGESIZE);
    const unsigned long long body = (front + nbytes + page - 1) / page * page;
    void* mem = mmap(nullptr, body + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return nullptr;
    if (mprotect(static_cast<char*>(mem) + body, page, PROT_NONE) != 0) {
        munmap(mem, body + page);
        return nullptr;
    }
    *base = (unsigned long long)(uintptr_t)mem;
    *length = body + page;
    return static_cast<char*>(mem) + body - nbytes;
}

void fgd_emu_fenced_free(unsigned long long base, unsigned long long length) {
    munmap(reinterpret_cast<void*>((uintptr_t)base), length);
}

// Why the last failed launch failed (the CUDA error code alone says little here).
const char* fgd_emu_last_message() { return emu::last_message.c_str(); }

void fgd_emu_clear_error() {
    emu::last_error = cudaSuccess;
    emu::last_message.clear();
}

// Seconds after which the watchdog interrupts a launch (emu.h); returns the previous value.
double fgd_emu_set_launch_timeout(double seconds) {
    emu::start_watchdog();
    const double was = emu::launch_timeout.load();
    if (seconds > 0) emu::launch_timeout = seconds;
    return was;
}

// 1: switch fibers with ucontext even where the assembly switch exists (both are tested).
// Returns the previous setting.
int fgd_emu_use_ucontext(int on) {
    const int was = emu::use_ucontext;
    if (on || FGD_EMU_ASM_SWITCH) emu::use_ucontext = on != 0 || emu::shadow_stack_active();
    return was;
}

// 0: blocks and threads in order; 1: both in reverse (a correct kernel gives the same bits).
void fgd_emu_set_reverse_schedule(int reverse) { emu::reverse_schedule = reverse != 0; }

// [launches, blocks, barriers] run so far.
void fgd_emu_stats(long long* out) {
    out[0] = emu::stat_launches;
    out[1] = emu::stat_blocks;
    out[2] = emu::stat_barriers;
}

void fgd_emu_float_to_half(const float* in, uint16_t* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = __float2half_rn(in[i]).bits;
}

void fgd_emu_half_to_float(const uint16_t* in, float* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = __half2float(__half{in[i]});
}

void fgd_emu_float_to_bfloat16(const float* in, uint16_t* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(in[i]).bits;
}

void fgd_emu_bfloat16_to_float(const uint16_t* in, float* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = __bfloat162float(__nv_bfloat16{in[i]});
}

}  // extern "C"

// ---- self-tests of the emulator (tests/test_cuda_emulated.py::test_emulator_*)

namespace selftest {

// Each thread publishes a value in shared memory and reads its neighbour's: right only when
// the barrier separates the writes from the reads.
__global__ void exchange(float* out, int sync) {
    __shared__ float s[1024];
    s[threadIdx.x] = (float)(threadIdx.x + 1000 * blockIdx.x);
    if (sync) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

// Each thread copies the element after its own: the last one reads past the end.
__global__ void read_past_end(const float* in, float* out) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i + 1];
}

// Each thread writes the element after its own: the last one writes past the end.
__global__ void write_past_end(const float* in, float* out) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i + 1] = in[i];
}

// Never ends (a volatile read each turn, so the loop cannot be optimised away).
__global__ void endless(float* out) {
    volatile int spin = 1;
    while (spin) {
    }
    out[threadIdx.x] = 1.0f;
}

// Half of the threads wait at a barrier the other half never reaches (undefined in CUDA).
__global__ void divergent(float* out) {
    if (threadIdx.x < blockDim.x / 2) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// Each thread reads its element of a shared array before any thread of its block wrote it
// (then writes it, for the next block to find): garbage, poisoned as NaN in every block.
__global__ void stale_shared(float* out) {
    __shared__ float s[1024];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
    __syncthreads();
    s[threadIdx.x] = 1.0f;
}

}  // namespace selftest

extern "C" int fgd_emu_selftest(int which, const float* in, float* out, int blocks, int threads) {
    fgd_emu_clear_error();
    switch (which) {
        case 0: selftest::exchange<<<blocks, threads>>>(out, 1); break;
        case 1: selftest::exchange<<<blocks, threads>>>(out, 0); break;
        case 2: selftest::divergent<<<blocks, threads>>>(out); break;
        case 3: selftest::read_past_end<<<blocks, threads>>>(in, out); break;
        case 4: selftest::write_past_end<<<blocks, threads>>>(in, out); break;
        case 5: selftest::endless<<<blocks, threads>>>(out); break;
        case 6: selftest::stale_shared<<<blocks, threads>>>(out); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}
