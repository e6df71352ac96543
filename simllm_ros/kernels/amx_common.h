/* What both AMX kernels (attention's bf16 path and int4_amx) need, inside their AMX guards: the tile
   configuration's layout, and Linux's permission for the tile state, which it hands out only to a process that
   asks (ARCH_REQ_XCOMP_PERM = 0x1023 for XTILEDATA = 18). */
#ifndef SIMLLM_AMX_COMMON_H
#define SIMLLM_AMX_COMMON_H

#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) tilecfg_t;
static int amx_request(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }
#endif
