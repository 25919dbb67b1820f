// CPU emulation (tests only): the subset of the CUDA runtime API that csrc/*.cu use.
// Shadows the toolkit's header (this folder comes first on the include path).
#pragma once

#include <string>

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchTimeout = 702,
    cudaErrorLaunchFailure = 719,
} cudaError_t;

typedef struct CUstream_st* cudaStream_t;

namespace emu {
// The emulator's error state. Like CUDA's, a launch error is returned (and cleared) by the
// next cudaGetLastError(); the message, which CUDA has no place for, is kept until the next
// error so the Python stand-in can quote it.
inline cudaError_t last_error = cudaSuccess;
inline std::string last_message;

inline void fail(cudaError_t code, const std::string& message) {
    if (last_error == cudaSuccess) {  // keep the first error, as CUDA does
        last_error = code;
        last_message = message;
    }
}
}  // namespace emu

inline cudaError_t cudaGetLastError() {
    const cudaError_t e = emu::last_error;
    emu::last_error = cudaSuccess;
    return e;
}

inline cudaError_t cudaPeekAtLastError() { return emu::last_error; }

inline const char* cudaGetErrorName(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
        case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
        case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
        case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    }
    return "cudaErrorUnknown";
}

inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
