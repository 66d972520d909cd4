// Tree checks: each call's workers send a digest of their psum's tree (and
// its description the first time); workers whose trees differ are told
// which leaf, naming both workers.
#include "server/server_impl.h"

namespace jbps {
namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// Names the first leaf where two workers' trees differ. A tree is "psum NAME"
// then one "PATH DTYPE[SHAPE]" line per leaf (jbps/ops/psum.py).
std::string TreeDifference(uint32_t rank_a, const std::string& a, uint32_t rank_b, const std::string& b) {
  const auto la = Lines(a), lb = Lines(b);
  const std::string wa = "worker " + std::to_string(rank_a), wb = "worker " + std::to_string(rank_b);
  const std::string call = la[0].rfind("psum ", 0) == 0 ? la[0].substr(5) : la[0];
  std::string msg = "workers disagree on the tree of psum '" + call + "': ";
  auto split = [](const std::string& line) {
    size_t sp = line.rfind(' ');
    return sp == std::string::npos ? std::make_pair(line, std::string())
                                   : std::make_pair(line.substr(0, sp), line.substr(sp + 1));
  };
  for (size_t i = 1; i < std::max(la.size(), lb.size()); ++i) {
    if (i < la.size() && i < lb.size() && la[i] == lb[i]) continue;
    if (i < la.size() && i < lb.size() && split(la[i]).first == split(lb[i]).first) {
      return msg + "tensor '" + call + split(la[i]).first + "': " + wa + " has " + split(la[i]).second + ", " + wb +
             " has " + split(lb[i]).second;
    }
    auto leaf = [&](const std::vector<std::string>& l) {
      return i < l.size() ? "tensor '" + call + split(l[i]).first + "' " + split(l[i]).second : std::string("nothing");
    };
    return msg + wa + " has " + std::to_string(la.size() - 1) + " leaves, " + wb + " has " +
           std::to_string(lb.size() - 1) + "; leaf " + std::to_string(i - 1) + ": " + wa + " has " + leaf(la) + ", " +
           wb + " has " + leaf(lb);
  }
  return msg + "the descriptions differ (" + wa + ": " + std::to_string(a.size()) + " bytes, " + wb + ": " +
         std::to_string(b.size()) + " bytes)";
}

}  // namespace

// Reads a tree check's payload and checks it (CheckTree). False, with *why,
// when the message is bad.
bool SummationServer::Impl::ReadTreeCheck(const ConnPtr& c, const FrameHeader& h, FrameReader* reader,
                                          std::string* why) {
  std::string payload(h.nbytes, '\0');  // bounded by ValidateHeader
  IoStatus st = reader->Read(payload.data(), payload.size());
  if (st != IoStatus::kOk) {
    *why = std::string("truncated tree check: ") + IoStatusName(st);
    return false;
  }
  uint64_t digest;
  std::memcpy(&digest, payload.data(), sizeof(digest));
  std::shared_ptr<const std::string> text;
  if (payload.size() > kTreeDigestBytes) {
    text = std::make_shared<const std::string>(payload, kTreeDigestBytes);
    // Kept while within the bounds, as the worker counts them: it sends this
    // tree's digest alone from now on.
    if (c->trees.count(digest) == 0 && c->trees.size() < kMaxDescribedTrees &&
        c->tree_bytes + text->size() <= kMaxDescribedTreeBytes) {
      c->trees.emplace(digest, text);
      c->tree_bytes += text->size();
    }
  } else {
    auto it = c->trees.find(digest);
    if (it == c->trees.end()) {
      *why = "a tree check of a tree it never described";
      return false;
    }
    text = it->second;
  }
  CheckTree(c, h, digest, std::move(text));
  return true;
}

// Every worker sends its call's tree digest under the call's tree key and
// round: while they agree nobody is answered (each push carries the digest,
// and a round of pushes that disagree gets no sum), and once they differ
// every worker's check fails, naming the first leaf that differs.
void SummationServer::Impl::CheckTree(const ConnPtr& c, const FrameHeader& h, uint64_t digest,
                                      std::shared_ptr<const std::string> text) {
  std::vector<std::pair<ConnPtr, std::string>> errors;
  {
    std::lock_guard<std::mutex> lock(trees_mu);
    const JobRoundKey k{c->epoch, h.key, h.round};
    auto it = tree_rounds.find(k);
    if (it == tree_rounds.end()) {
      if (tree_rounds.size() >= opt.max_keys) {
        errors.emplace_back(c,
                            "the server already waits on " + std::to_string(opt.max_keys) + " tree checks, its limit");
      } else {
        it = tree_rounds.emplace(k, TreeRound{}).first;
        it->second.digest = digest;
        it->second.first_rank = c->rank;
        it->second.first_text = text;
        it->second.checked.assign(opt.num_workers, false);
      }
    }
    if (it != tree_rounds.end()) {
      TreeRound& r = it->second;
      if (r.checked[c->rank]) {
        errors.emplace_back(
            c, "duplicate tree check of round " + std::to_string(h.round) + " from worker " + std::to_string(c->rank));
      } else {
        r.checked[c->rank] = true;
        ++r.count;
        r.waiters.push_back(c);
        if (r.error.empty() && digest != r.digest) {
          r.error = TreeDifference(r.first_rank, *r.first_text, c->rank, *text);
          for (auto& w : r.waiters) errors.emplace_back(w, r.error);
        } else if (!r.error.empty()) {
          errors.emplace_back(c, r.error);
        }
        if (r.count == opt.num_workers) tree_rounds.erase(it);
      }
    }
  }
  for (auto& [w, msg] : errors) SendError(w, h.key, h.round, msg);
}

}  // namespace jbps
