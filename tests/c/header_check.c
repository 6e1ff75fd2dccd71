#include "halo.h"
int main(void) { return halo_version_number() == HALO_VERSION_NUMBER ? 0 : 1; }
