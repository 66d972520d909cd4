// TcpTransport: a push's bytes follow its header on the socket, gathered by
// sendmsg straight from XLA's buffers; a sum's are read from the socket into
// its outputs.
#include "transport/transport.h"

namespace jbps {

void TcpTransport::StagePush(int, const std::vector<Segment>& parts, size_t nbytes, FrameHeader* h, ShmRef*,
                             std::vector<struct iovec>* iov) const {
  h->type = static_cast<uint16_t>(MsgType::kPush);
  h->nbytes = nbytes;
  for (const Segment& s : parts) iov->push_back({const_cast<void*>(s.data), s.nbytes});
}

bool TcpTransport::TakeSum(const Frame& f, FrameReader* reader, const std::vector<Destination>* out,
                           std::string* why) const {
  IoStatus st = IoStatus::kOk;
  if (out == nullptr) {
    st = reader->Skip(f.payload);
    if (st != IoStatus::kOk) *why = "truncated sum";
    return st == IoStatus::kOk;
  }
  for (const Destination& d : *out) {
    st = reader->Read(d.data, d.nbytes);
    if (st != IoStatus::kOk) break;
  }
  if (st != IoStatus::kOk) *why = std::string("receiving a sum: ") + IoStatusName(st);
  return st == IoStatus::kOk;
}

}  // namespace jbps
