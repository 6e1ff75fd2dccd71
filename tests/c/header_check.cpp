#include "halo.h"
#include "halo.h"
int check() { halo_comm_t c = nullptr; return c ? 1 : HALO_SUCCESS; }
