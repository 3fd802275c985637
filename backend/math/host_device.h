// PIPESHARD_HD marks a function that runs on both sides: __host__ __device__ under nvcc,
// nothing under a host compiler. The formulas the kernels share with the host tests
// (elementwise_math.cuh, convert_math.cuh) are written with it, so that g++ compiles them
// too and the tests check the very code the kernels run.
#ifndef PIPESHARD_BACKEND_MATH_HOST_DEVICE_H_
#define PIPESHARD_BACKEND_MATH_HOST_DEVICE_H_

#ifdef __CUDACC__
#define PIPESHARD_HD __host__ __device__
#else
#define PIPESHARD_HD
#endif

#endif  // PIPESHARD_BACKEND_MATH_HOST_DEVICE_H_
