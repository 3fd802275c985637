// CRC-32C (Castagnoli): the checksum of TFRecord files, and so of TensorBoard's event
// files (observe/tensorboard.h).
#ifndef PIPESHARD_COMMON_CRC32C_H_
#define PIPESHARD_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace pipeshard {

// CRC-32C of `bytes` (reflected polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF; iSCSI's, RFC 3720): crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view bytes);

// TFRecord's masked form of a CRC, ((crc >> 15) | (crc << 17)) + 0xA282EAD8: a CRC of
// data that itself holds CRCs is otherwise weak.
inline uint32_t mask_crc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }

}  // namespace pipeshard

#endif  // PIPESHARD_COMMON_CRC32C_H_
