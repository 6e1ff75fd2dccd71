package ucx

// Resources lists the transports and devices UCX finds on this machine, the
// way "ucx_info -d" does, through libuct: every component, its memory
// domains, and the transport resources of each. It lives here, beside the
// libucp binding, so that cgo to UCX stays in one package.

/*
#cgo LDFLAGS: -luct -lucs
#include <stdlib.h>
#include <string.h>
#include <uct/api/uct.h>

typedef struct {
    char component[UCT_COMPONENT_NAME_MAX];
    char md[UCT_MD_NAME_MAX];
    char tl[UCT_TL_NAME_MAX];
    char dev[UCT_DEVICE_NAME_MAX];
    int  type;
} hi_resource_t;

// hi_list fills *out (malloc'ed, freed by the caller) with every transport
// resource of every memory domain that opens, and returns their number, or
// a negative ucs_status_t if the components cannot be listed.
static int hi_list(hi_resource_t **out)
{
    uct_component_h *comps;
    unsigned ncomps, c, m, t;
    int n = 0, cap = 16;
    ucs_status_t st;
    hi_resource_t *res = malloc(cap * sizeof(*res));

    *out = NULL;
    if (res == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    st = uct_query_components(&comps, &ncomps);
    if (st != UCS_OK) {
        free(res);
        return st;
    }
    for (c = 0; c < ncomps; c++) {
        uct_component_attr_t attr;
        memset(&attr, 0, sizeof(attr));
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (uct_component_query(comps[c], &attr) != UCS_OK || attr.md_resource_count == 0) {
            continue;
        }
        attr.md_resources = calloc(attr.md_resource_count, sizeof(*attr.md_resources));
        if (attr.md_resources == NULL) {
            continue;
        }
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        if (uct_component_query(comps[c], &attr) != UCS_OK) {
            free(attr.md_resources);
            continue;
        }
        for (m = 0; m < attr.md_resource_count; m++) {
            uct_md_config_t *cfg;
            uct_md_h md;
            uct_tl_resource_desc_t *tls;
            unsigned ntls;
            const char *mdname = attr.md_resources[m].md_name;

            if (uct_md_config_read(comps[c], NULL, NULL, &cfg) != UCS_OK) {
                continue;
            }
            st = uct_md_open(comps[c], mdname, cfg, &md);
            uct_config_release(cfg);
            if (st != UCS_OK) {
                continue;
            }
            if (uct_md_query_tl_resources(md, &tls, &ntls) == UCS_OK) {
                for (t = 0; t < ntls; t++) {
                    if (n == cap) {
                        hi_resource_t *r = realloc(res, 2 * cap * sizeof(*res));
                        if (r == NULL) {
                            break;
                        }
                        res = r;
                        cap *= 2;
                    }
                    memset(&res[n], 0, sizeof(res[n]));
                    strncpy(res[n].component, attr.name, sizeof(res[n].component) - 1);
                    strncpy(res[n].md, mdname, sizeof(res[n].md) - 1);
                    strncpy(res[n].tl, tls[t].tl_name, sizeof(res[n].tl) - 1);
                    strncpy(res[n].dev, tls[t].dev_name, sizeof(res[n].dev) - 1);
                    res[n].type = tls[t].dev_type;
                    n++;
                }
                uct_release_tl_resource_list(tls);
            }
            uct_md_close(md);
        }
        free(attr.md_resources);
    }
    uct_release_component_list(comps);
    *out = res;
    return n;
}
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Resource is one transport on one device, as UCX lists it.
type Resource struct {
	Transport    string `json:"transport"`     // tcp, posix, sysv, cma, rc_mlx5, ...
	Device       string `json:"device"`        // eth0, mlx5_0:1, memory, ...
	Type         string `json:"type"`          // network, shared memory, accelerator, loopback
	MemoryDomain string `json:"memory_domain"` // the memory domain that provides it
	Component    string `json:"component"`
}

func deviceType(t C.int) string {
	switch t {
	case C.UCT_DEVICE_TYPE_NET:
		return "network"
	case C.UCT_DEVICE_TYPE_SHM:
		return "shared memory"
	case C.UCT_DEVICE_TYPE_ACC:
		return "accelerator"
	case C.UCT_DEVICE_TYPE_SELF:
		return "loopback"
	}
	return fmt.Sprintf("type %d", int(t))
}

// Resources lists every transport resource of every memory domain that
// UCX can open here. UCX_TLS and UCX_NET_DEVICES do not filter this list;
// they act when a UCP context picks among these.
func Resources() ([]Resource, error) {
	var p *C.hi_resource_t
	n := C.hi_list(&p)
	if n < 0 {
		return nil, fmt.Errorf("ucx: uct_query_components: %s", C.GoString(C.ucs_status_string(C.ucs_status_t(n))))
	}
	defer C.free(unsafe.Pointer(p))
	var out []Resource
	for _, r := range unsafe.Slice(p, int(n)) {
		out = append(out, Resource{
			Transport:    C.GoString(&r.tl[0]),
			Device:       C.GoString(&r.dev[0]),
			Type:         deviceType(r._type),
			MemoryDomain: C.GoString(&r.md[0]),
			Component:    C.GoString(&r.component[0]),
		})
	}
	return out, nil
}
