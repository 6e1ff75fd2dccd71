package ucx

/*
#include <stdlib.h>
#include "helpers.h"

// Creates an endpoint to addr and force-closes it at once: what Connect
// does with an address, without keeping anything. The close loop is bounded
// so that a probe cannot hang a test; a close that does not finish leaks
// its request.
static ucs_status_t hux_probe_address(ucp_worker_h worker, const void *addr)
{
    ucp_ep_params_t params = {0};
    ucp_request_param_t close = {0};
    ucs_status_t st;
    ucp_ep_h ep;
    void *req;
    long i;

    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address    = (const ucp_address_t *)addr;
    st = ucp_ep_create(worker, &params, &ep);
    if (st != UCS_OK) {
        return st;
    }
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags        = UCP_EP_CLOSE_FLAG_FORCE;
    req = ucp_ep_close_nbx(ep, &close);
    if (UCS_PTR_IS_PTR(req)) {
        for (i = 0; i < 1000000 && ucp_request_check_status(req) == UCS_INPROGRESS; i++) {
            ucp_worker_progress(worker);
        }
        if (ucp_request_check_status(req) != UCS_INPROGRESS) {
            ucp_request_free(req);
        }
    }
    ucp_worker_progress(worker);
    return UCS_OK;
}
*/
import "C"

// probeAddress hands peer to ucp_ep_create as Connect would, and closes the
// endpoint again. It exists for the tests that show CheckAddress keeps
// UCX's assertions away: it does not check peer first.
func (t *Transport) probeAddress(peer []byte) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.c == nil {
		return ErrClosed
	}
	ca := C.CBytes(peer)
	defer C.free(ca)
	if st := C.hux_probe_address(t.c.worker, ca); st != C.UCS_OK {
		return statusError("ucp_ep_create", st)
	}
	return nil
}
